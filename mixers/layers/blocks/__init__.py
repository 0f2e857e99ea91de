"""The building blocks the mixers (and the model) are made of, apart from the mixers themselves.

* :mod:`.norm`: ``RMSNorm``, ``GatedRMSNorm``; :mod:`.norm_linear`: a mixer's ``linear(norm(x, gate))``
  output path as one function;
* :mod:`.projections`: several projections of one input with one input gradient;
* :mod:`.short_conv`: the short causal convolution (:mod:`.short_conv_cache`: its cached form);
* :mod:`.rotary`: rotary position embeddings; :mod:`.mlp`: the SwiGLU MLP;
* :mod:`.decay_gate`: the decay gate of the gated delta layers; :mod:`.init`: parameter initialisations.

Each is one autograd function (or a module over one) that keeps only what its backward needs and,
on a CPU, runs over blocks of rows (:mod:`mixers.ops.device_policy`).
"""
