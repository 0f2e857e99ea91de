import pytest

from ssm_pack import PackedSeqParams, resolve_cp_group, resolve_tp_cp_group


class Group:
    def __init__(self, size, name=""):
        self._size, self.name = size, name

    def size(self):
        return self._size


STATIC_CP, STATIC_TP_CP, TP = Group(4, "static-cp"), Group(8, "static-tp-cp"), Group(2, "tp")


def test_cp_group_static_without_microbatch_group():
    assert resolve_cp_group(STATIC_CP) is STATIC_CP
    assert resolve_cp_group(STATIC_CP, PackedSeqParams()) is STATIC_CP
    assert resolve_cp_group(None, None) is None


def test_cp_group_microbatch_group_wins_singleton_included():
    single = Group(1)
    assert resolve_cp_group(STATIC_CP, PackedSeqParams(local_cp_size=1, cp_group=single)) is single
    two = Group(2)
    assert resolve_cp_group(STATIC_CP, PackedSeqParams(cp_group=two)) is two


def test_cp_group_mismatch_names_both_sizes():
    params = PackedSeqParams(validate=False, local_cp_size=2, cp_group=Group(4))
    with pytest.raises(ValueError, match="size 4 but local_cp_size=2"):
        resolve_cp_group(STATIC_CP, params)
    params = PackedSeqParams(validate=False, local_cp_size=2)
    with pytest.raises(ValueError, match="cp_group is None"):
        resolve_cp_group(STATIC_CP, params)


def test_tp_cp_group_resolution():
    assert resolve_tp_cp_group(STATIC_TP_CP, None, sequence_parallel=True, tp_group=TP) is STATIC_TP_CP
    own = Group(4)
    params = PackedSeqParams(local_cp_size=2, cp_group=Group(2), tp_cp_group=own)
    assert resolve_tp_cp_group(STATIC_TP_CP, params, sequence_parallel=True, tp_group=TP) is own
    single = PackedSeqParams(local_cp_size=1, cp_group=Group(1))
    assert resolve_tp_cp_group(STATIC_TP_CP, single, sequence_parallel=True, tp_group=TP) is TP
    pair = PackedSeqParams(local_cp_size=2, cp_group=Group(2))
    assert resolve_tp_cp_group(STATIC_TP_CP, pair, sequence_parallel=False, tp_group=TP) is None


def test_tp_cp_group_errors():
    bad = PackedSeqParams(local_cp_size=2, cp_group=Group(2), tp_cp_group=Group(6))
    with pytest.raises(ValueError, match="size 6 but tp_size \\* cp_size = 2 \\* 2 = 4"):
        resolve_tp_cp_group(STATIC_TP_CP, bad, sequence_parallel=True, tp_group=TP)
    pair = PackedSeqParams(local_cp_size=2, cp_group=Group(2))
    with pytest.raises(ValueError, match="tp_cp_group is None"):
        resolve_tp_cp_group(STATIC_TP_CP, pair, sequence_parallel=True, tp_group=TP)
    with pytest.raises(TypeError, match="sequence_parallel must be a bool"):
        resolve_tp_cp_group(STATIC_TP_CP, pair, sequence_parallel="yes", tp_group=TP)
    with pytest.raises(ValueError, match="tp_group is None"):
        resolve_tp_cp_group(STATIC_TP_CP, pair, sequence_parallel=True, tp_group=None)
