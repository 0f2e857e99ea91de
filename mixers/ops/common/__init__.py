"""What the op folders share: argument checks (:mod:`.checks`), the compute dtype, chunk and row-block
helpers (:mod:`.chunks`), autocast off at each op's entry (:mod:`.autocast`), non-finite isolation
(:mod:`.isolation`), per-document states on short token runs (:mod:`.grouped`), in-place writes
(:mod:`.inplace`), decode-step slot indices (:mod:`.slots`), the documents the ``naive.py`` specs
walk (:mod:`.naive_documents`) and the context-parallel collectives (:mod:`.cp_exchange`).

The backend choice (:mod:`mixers.ops.dispatch`) and the device policy
(:mod:`mixers.ops.device_policy`) stay beside the op folders: they are the ops' visible decisions.
"""
