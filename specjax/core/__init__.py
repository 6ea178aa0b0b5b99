"""The decoding core: the engine's jitted prefill/step/generate loop
(``engine``) over a target and a drafter, exact chain and tree verification
(``verify``, ``tree``), sampling and its warps (``sampling``), the KV cache
with per-row lengths (``cache``), per-row gathers and scatters (``rows``),
shape buckets (``bucketing``), the host-side runner (``runner``) and the
layout on a device mesh (``sharding``). It imports no trainer."""
