"""Helpers the tests share: per-document oracles and tolerances, strict fakes of the upstream kernels,
the fake-device mode, the leakage report, a Megatron-core stand-in, an allocation recorder."""
