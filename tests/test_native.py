"""The native CPU kernels (specjax/kernels/): the small-row
matmul gives XLA's product for every row count a decode or verify step uses,
inside compiled loops; the attention gives XLA's over ragged caches and tree
masks; an XLA fallback says why it is used."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from specjax.kernels import attention as native_attention
from specjax.kernels import native, small_gemm

# SmolLM2's matrices, and odd ones: N not a multiple of 16, odd K, N < 16.
SHAPES = [(576, 1728), (576, 3072), (1536, 576), (577, 1000), (5, 17),
          (64, 3)]
ROWS = [1, 2, 3, 5, 6, 7, 8, 13, 16, 31, 64, 65, 100, 131]


@pytest.mark.parametrize("K,N", SHAPES)
def test_small_matmul_equals_xla_dot(K, N):
  """Invariant: for M = 1..64 rows (every register-block remainder) and
  past 64 (the many-row path: packed full blocks, a partial last block)
  the kernel's product equals XLA's ``x @ W`` to 1e-5 relative (f32)."""
  assert native.available(), "built with the package (setup.py)"
  rng = np.random.default_rng(K * N)
  w = jnp.asarray(rng.standard_normal((K, N)), jnp.float32)
  packed = small_gemm.pack(w)
  assert packed.shape == (-(-N // small_gemm.LANES), K, small_gemm.LANES)
  np.testing.assert_array_equal(small_gemm.unpack(packed, N), w)
  f = jax.jit(lambda x, p: small_gemm.small_matmul(x, p, N))
  for M in ROWS:
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
    ref = np.asarray(x @ w)
    np.testing.assert_allclose(np.asarray(f(x, packed)), ref, rtol=1e-5,
                               atol=1e-5 * np.abs(ref).max())


@pytest.mark.parametrize("K,N", [(576, 1728), (577, 1000), (5, 17)])
@pytest.mark.parametrize("use_native", [True, False])
def test_bf16_panels_give_the_f32_product(K, N, use_native, monkeypatch):
  """Invariant: for weights bf16 holds exactly, bf16 panels (half the
  bytes) give the f32 panels' product bit for bit, on the kernel and on
  the XLA fallback, for M = 1..64; ``exact_in`` says which weights qualify.
  """
  if not use_native:
    monkeypatch.setattr(native, "_status", {"ok": False})
  rng = np.random.default_rng(K + N)
  w = jnp.asarray(rng.standard_normal((K, N)), jnp.bfloat16).astype(
      jnp.float32)
  assert small_gemm.exact_in(w, jnp.bfloat16)
  assert not small_gemm.exact_in(w + 1e-4, jnp.bfloat16)
  p32, p16 = small_gemm.pack(w), small_gemm.pack(w, jnp.bfloat16)
  assert p16.dtype == jnp.bfloat16 and p16.shape == p32.shape
  f = jax.jit(lambda x, p: small_gemm.small_matmul(x, p, N))
  for M in ROWS:
    x = jnp.asarray(rng.standard_normal((M, K)), jnp.float32)
    np.testing.assert_array_equal(np.asarray(f(x, p16)),
                                  np.asarray(f(x, p32)))


def test_small_matmul_runs_inside_compiled_loops():
  """Invariant: the custom call is part of the program: it runs inside
  ``lax.fori_loop`` under ``jit`` (no host callback) with the result of
  the same loop over XLA's dot."""
  rng = np.random.default_rng(1)
  w = jnp.asarray(rng.standard_normal((48, 48)) / 7, jnp.float32)
  x = jnp.asarray(rng.standard_normal((3, 48)), jnp.float32)
  packed = small_gemm.pack(w)
  loop = lambda mm: jax.jit(lambda x: jax.lax.fori_loop(
      0, 5, lambda i, h: jnp.tanh(mm(h)), x))
  np.testing.assert_allclose(
      loop(lambda h: small_gemm.small_matmul(h, packed, 48))(x),
      loop(lambda h: h @ w)(x), rtol=1e-5, atol=1e-6)


def test_switched_off_it_warns_once_and_uses_xla(monkeypatch):
  """Invariant: with SPECJAX_NATIVE=0 (or no library) ``available()`` is
  False with one warning line naming the reason, and the product is XLA's
  on the packed layout, equal to the dot."""
  monkeypatch.setattr(native, "_status", {})
  monkeypatch.setenv("SPECJAX_NATIVE", "0")
  with pytest.warns(RuntimeWarning, match="SPECJAX_NATIVE=0") as record:
    assert not native.available()
    assert not native.available()
  assert len(record) == 1
  rng = np.random.default_rng(2)
  w = jnp.asarray(rng.standard_normal((40, 20)), jnp.float32)
  x = jnp.asarray(rng.standard_normal((4, 40)), jnp.float32)
  np.testing.assert_allclose(small_gemm.small_matmul(x, small_gemm.pack(w), 20),
                             x @ w, rtol=1e-5, atol=1e-5)
  monkeypatch.setattr(native, "_status", {})
  monkeypatch.setattr(native, "LIBRARY", native.LIBRARY.with_name("none.so"))
  monkeypatch.delenv("SPECJAX_NATIVE")
  with pytest.warns(RuntimeWarning, match="none.so not built"):
    assert not native.available()


def _cpu_flags() -> set:
  with open("/proc/cpuinfo") as f:
    return set(next(l for l in f if l.startswith("flags")).split())


ISAS = ("generic", "avx2", "avx512")  # the kernels' variants, narrowest first


def test_isa_is_the_widest_the_cpu_has_unless_capped():
  """Invariant: the kernels run the widest variant the CPU has (AVX-512,
  else AVX2 + FMA, else plain C++), or the cap SPECJAX_NATIVE_ISA names."""
  import os
  flags = _cpu_flags()
  widest = ("avx512" if {"avx512f", "avx2", "fma"} <= flags else
            "avx2" if {"avx2", "fma"} <= flags else "generic")
  cap = os.environ.get("SPECJAX_NATIVE_ISA", "avx512")
  assert native.isa() == ISAS[min(ISAS.index(widest), ISAS.index(cap))]


# The variants narrower than the one this process runs (the tests above):
# AVX2 and plain C++ on an AVX-512 CPU, plain C++ on an AVX2 one.
NARROWER = (list(ISAS[:ISAS.index(native.isa())][::-1])
            if native.isa() in ISAS else ["avx2", "generic"])


@pytest.mark.long  # ~40 s a cap: a second pytest process (CI's second stage)
@pytest.mark.parametrize("cap", NARROWER)
def test_narrower_variants_give_the_same_products(cap):
  """Invariant: capped to AVX2 (or plain C++) on a wider CPU, the kernels'
  tests above all hold: the matmul for every row count and shape, bf16
  panels, attention over ragged caches and tree masks, prefill chunks (a
  pytest run in a process with SPECJAX_NATIVE_ISA set, whose isa test
  checks the cap). A cap at the CPU's own variant would rerun the tests
  above unchanged, so only narrower ones run."""
  import os
  import subprocess
  import sys
  tests = ("isa_is_the_widest or small_matmul_equals_xla or bf16_panels or "
           "attention_equals_xla or prefill_chunk or prefill_in_chunks")
  run = subprocess.run(
      [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider",
       __file__, "-k", tests], capture_output=True, text=True,
      env={**os.environ, "SPECJAX_NATIVE_ISA": cap})
  assert run.returncode == 0, run.stdout[-3000:]
  assert " passed" in run.stdout and "failed" not in run.stdout


def test_on_by_default_only_for_f32_on_the_cpu(monkeypatch):
  """Invariant: ``load_model`` packs (``default_on``) for f32 weights on the
  CPU backend with the kernel available, and for nothing else."""
  assert native.default_on(jnp.float32)
  assert not native.default_on(jnp.bfloat16)
  monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
  assert not native.default_on(jnp.float32)


def test_vmap_over_the_custom_call():
  """Invariant: a vmapped forward (the custom call has a batching rule)
  equals the dot."""
  rng = np.random.default_rng(4)
  w = jnp.asarray(rng.standard_normal((24, 40)), jnp.float32)
  x = jnp.asarray(rng.standard_normal((3, 2, 24)), jnp.float32)
  f = jax.vmap(lambda x: small_gemm.small_matmul(x, small_gemm.pack(w), 40))
  np.testing.assert_allclose(jax.jit(f)(x), x @ w, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("B,T,N,G,H,S,lengths", [
    (1, 1, 9, 3, 64, 512, [256]),  # SmolLM2 decode
    (1, 16, 9, 3, 64, 512, [250]),  # SmolLM2 verify of 16
    (2, 17, 4, 2, 16, 64, [30, 5]),  # new tokens over two blocks of 16
    (3, 5, 4, 2, 8, 40, [0, 7, 35]),  # ragged, an empty row
    (2, 8, 6, 3, 16, 20, [12, 3]),  # the last row's new tokens fill it
    (2, 4, 4, 4, 8, 16, [14, 2]),  # new tokens past the capacity
    (2, 3, 10, 2, 40, 36, [5, 31]),  # 5 queries a kv head, H = 5 vectors
    (1, 2, 2, 1, 12, 9, [3]),  # H not a multiple of 8: the plain C++
    (1, 3, 3, 1, 16, 48, [17]),  # a 16-slot block spills past the prefix
    (2, 100, 9, 3, 64, 420, [300, 0])])  # past 64 tokens: tasks of 16
def test_attention_equals_xla_and_never_reads_stale_slots(B, T, N, G, H, S,
                                                         lengths):
  """Invariants: attention of T new tokens over a ragged cache prefix plus
  their own keys/values under a random tree mask (each token sees itself):
  the native kernel equals ``layers.attention`` (1e-5); that equals the new
  entries written into the cache and attended there (``query_mask``,
  ``new=None``: the EAGLE heads' form) wherever they fit; with NaN/inf in
  every cache slot past a row's prefix nothing changes: stale slots are
  not read, by either."""
  from specjax.core.cache import KVCache, write_kv
  from specjax.models import decoder, layers
  rng = np.random.default_rng(B * T * S)
  normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
  q, k, v = normal(B, T, N, H), normal(B, G, H, S), normal(B, G, S, H)
  k_new, v_new = normal(B, T, G, H), normal(B, T, G, H)
  lens = jnp.asarray(lengths, jnp.int32)
  mask = jnp.asarray(rng.random((B, T, T)) < 0.5) | jnp.eye(T, dtype=bool)[None]
  prefix = (jnp.arange(S)[None, :] < lens[:, None])[:, None, :]
  new = (k_new, v_new, jnp.repeat(mask, N // G, axis=1))
  ref = layers.attention(q, k, v, prefix, new=new)
  f = jax.jit(native_attention.attention)
  np.testing.assert_allclose(f(q, k, v, k_new, v_new, lens, mask), ref,
                             atol=1e-5)
  kw, vw = write_kv(jnp.asarray(k), jnp.asarray(v), k_new, v_new,
                    KVCache(k=(k,), v=(v,), lengths=lens).new_slots(T))
  written = layers.attention(q, kw, vw, layers.query_mask(lens, mask, S,
                                                        N // G))
  for b in range(B):
    if lengths[b] + T <= S:
      np.testing.assert_allclose(written[b], ref[b], atol=1e-5)
  for b, used in enumerate(lengths):
    k[b, :, :, used:], v[b, :, used:] = np.nan, np.inf
  np.testing.assert_allclose(f(q, k, v, k_new, v_new, lens, mask), ref,
                             atol=1e-5)
  # XLA's attention (GPU/TPU, bf16, prefill) ignores them too.
  np.testing.assert_allclose(layers.attention(q, k, v, prefix, new=new), ref,
                             atol=1e-5)


@pytest.mark.parametrize("T,lengths", [(65, [0, 3]), (130, [512, 77])])
def test_attention_of_a_prefill_chunk_equals_xla(T, lengths):
  """Invariant: a causal chunk of T > 64 new tokens (tasks of 16 tokens,
  each reading the new tokens up to the last one it sees) over a ragged
  prefix, the first chunk (no prefix) included, equals
  ``layers.attention`` (1e-5), with NaN/inf in the slots past each prefix
  (never read)."""
  from specjax.models import layers
  B, N, G, H, S = 2, 9, 3, 64, 640
  rng = np.random.default_rng(T)
  normal = lambda *shape: rng.standard_normal(shape).astype(np.float32)
  q, k, v = normal(B, T, N, H), normal(B, G, H, S), normal(B, G, S, H)
  k_new, v_new = normal(B, T, G, H), normal(B, T, G, H)
  lens = jnp.asarray(lengths, jnp.int32)
  mask = layers.causal_mask(B, T)
  prefix = (jnp.arange(S)[None, :] < lens[:, None])[:, None, :]
  ref = layers.attention(q, k, v, prefix,
                         new=(k_new, v_new, jnp.repeat(mask, N // G, axis=1)))
  for b, used in enumerate(lengths):
    k[b, :, :, used:], v[b, :, used:] = np.nan, np.inf
  got = jax.jit(native_attention.attention)(q, k, v, k_new, v_new, lens, mask)
  np.testing.assert_allclose(got, ref, atol=1e-5)


@pytest.mark.parametrize("packed", [False, True])
def test_forward_without_writing_leaves_the_cache_untouched(tmp_path,
                                                           packed):
  """Invariants, XLA's path and the native one: a forward with
  ``write_cache=False`` gives the logits of the writing forward (1e-5 of
  the largest) under a tree mask, returns the cache it got (same buffers'
  values, same lengths) and, as ``new_kv``, exactly the entries the writing
  forward put at ``lengths + t``; ``KVCache.write`` of them rebuilds that
  cache."""
  from specjax.models import decoder, layers
  from specjax import testing
  cfg, params = testing.tiny("llama_gqa_tied", seed=6)
  params = decoder.pack_params(params) if packed else params
  rng = np.random.default_rng(8)
  prompt = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 9)), jnp.int32)
  pre = decoder.forward(params, cfg, prompt, decoder.init_cache(cfg, 2, 32))
  cache = pre.cache.with_lengths(jnp.asarray([9, 4], jnp.int32))
  new = jnp.asarray(rng.integers(0, cfg.vocab_size, (2, 5)), jnp.int32)
  parents = jnp.asarray([[0, 0, 0, 1, 2]] * 2, jnp.int32)
  from specjax.core import tree
  anc = tree.ancestors(parents, jnp.ones((2, 5), bool))
  pos = tree.positions(cache.lengths, anc)
  fwd = jax.jit(lambda c, w: decoder.forward(params, cfg, new, c,
                                           positions_BT=pos, mask_BTT=anc,
                                           write_cache=w),
                static_argnums=1)
  wrote, kept = fwd(cache, True), fwd(cache, False)
  _assert_close(kept.logits, wrote.logits)
  np.testing.assert_array_equal(kept.cache.lengths, cache.lengths)
  for a, b in zip(kept.cache.k + kept.cache.v, cache.k + cache.v):
    np.testing.assert_array_equal(a, b)
  rebuilt = cache.write(kept.new_kv, cache.new_slots(5))
  for a, b in zip(rebuilt.k + rebuilt.v, wrote.cache.k + wrote.cache.v):
    np.testing.assert_array_equal(a, b)


def _logits(params, cfg, prompt_BT, new_BT):
  """Logits of a prefill over ``prompt_BT`` and of a verify-like forward
  over ``new_BT`` on top of it."""
  from specjax.models import decoder, layers
  B = prompt_BT.shape[0]
  fwd = jax.jit(lambda p, t, c: decoder.forward(p, cfg, t, c))
  first = fwd(params, prompt_BT, decoder.init_cache(cfg, B, 64))
  return first.logits, fwd(params, new_BT, first.cache).logits


def _assert_close(a, b):
  a, b = np.asarray(a), np.asarray(b)
  np.testing.assert_allclose(a, b, rtol=0, atol=1e-5 * np.abs(b).max())


@pytest.mark.long
def test_packed_model_decodes_like_the_plain_one(tmp_path):
  """Invariants on a tiny random Llama: with every matmul and the LM head
  packed for the kernel (``pack_params``) the logits of a prefill and of a
  5-token verify equal XLA's (1e-5 of the largest), and AR and n-gram
  speculative decoding emit the plain model's greedy tokens."""
  from specjax.core import engine
  from specjax.drafters import NGramDrafter
  from specjax.models import decoder, layers
  from specjax import testing
  from tests.test_speculative import _run
  cfg, params = testing.tiny("llama_gqa_tied", seed=5)
  packed = decoder.pack_params(params)
  assert isinstance(packed.layers[0].wqkv, layers.PackedWeight)
  rng = np.random.default_rng(3)
  prompt, new = (jnp.asarray(rng.integers(0, cfg.vocab_size, (3, t)),
                             jnp.int32) for t in (13, 5))
  for a, b in zip(_logits(packed, cfg, prompt, new),
                  _logits(params, cfg, prompt, new)):
    _assert_close(a, b)
  for dcfg in (engine.DecodeConfig(capacity=64),
               engine.DecodeConfig(capacity=64, drafter=NGramDrafter(),
                                   num_draft=4)):
    assert _run(packed, cfg, dcfg)[0] == _run(params, cfg, dcfg)[0]


def test_packed_smollm2_logits_equal_xla(smollm2):
  """Invariant: on SmolLM2-135M (real weights, a real prompt) the packed
  model's prefill and 8-token verify logits equal XLA's to 1e-5 of the
  largest."""
  from specjax.models import decoder, layers
  ids = smollm2.tokenizer.encode("The capital of France is Paris. The "
                                 "capital of Italy is")
  prompt = jnp.asarray([ids, ids[::-1]], jnp.int32)
  new = jnp.asarray([ids[:8], ids[-8:]], jnp.int32)
  from specjax.models.registry import load_model
  plain = load_model("smollm2-135m", native=False).params
  packed = decoder.pack_params(plain)
  np.testing.assert_array_equal(decoder.lm_head_VD(packed), plain.embed)
  for a, b in zip(_logits(packed, smollm2.config, prompt, new),
                  _logits(plain, smollm2.config, prompt, new)):
    _assert_close(a, b)


@pytest.mark.parametrize("variant", [
    "eagle3", pytest.param("eagle1", marks=pytest.mark.long),
    pytest.param("mtp", marks=pytest.mark.long)])
@pytest.mark.parametrize("in_bf16", [False, True])
def test_packed_head_equals_plain(variant, in_bf16):
  """Invariant: an EAGLE or MTP head whose dense kernels are packed for the
  kernel (``pack_head``; EAGLE-1's fc has a bias) computes the plain head's logits
  to 1e-5 of the largest, over 1 and 4 rows (a chain step, a tree level),
  and its parameters keep the plain ones' names. A head whose weights bf16
  holds exactly is packed in bf16, any other in f32."""
  from flax.traverse_util import flatten_dict

  from specjax.heads import head_module
  from specjax.heads.base import HeadConfig, pack_head
  from specjax.models import decoder, layers
  cfg = HeadConfig(target_dim=48, target_vocab=101, target_layers=4,
                   taps=(1, 2, 3) if variant == "eagle3" else (4,),
                   num_heads=4, num_kv_heads=2, head_dim=12, ffn_dim=80,
                   draft_vocab=57 if variant == "eagle3" else 101,
                   variant=variant, qk_norm=variant == "mtp")
  head = head_module(cfg)
  rng = np.random.default_rng(7)
  embed = jnp.asarray(rng.standard_normal((101, 48)), jnp.float32)
  for T in (1, 4):
    taps = jnp.asarray(rng.standard_normal((2, T, 48 * len(cfg.taps))),
                       jnp.float32)
    tok = jnp.asarray(rng.integers(0, 101, (2, T)), jnp.int32)
    pos = jnp.broadcast_to(jnp.arange(T), (2, T))
    params = head.init(jax.random.key(T), taps, tok, embed, pos)["params"]
    if in_bf16:
      params = jax.tree.map(
          lambda x: x.astype(jnp.bfloat16).astype(jnp.float32), params)
    packed = pack_head(params)
    assert isinstance(packed["lm_head"]["kernel"], layers.PackedWeight)
    assert packed["lm_head"]["kernel"].panels.dtype == (
        jnp.bfloat16 if in_bf16 else jnp.float32)
    assert flatten_dict(packed).keys() == flatten_dict(params).keys()
    run = jax.jit(lambda p: head.apply({"params": p}, taps, tok, embed, pos))
    _assert_close(run(packed), run(params))


def test_shipped_head_is_packed_on_a_packed_target(smollm2):
  """Invariant: ``methods.build`` packs the EAGLE-3 head when the target
  runs on the native path (``load_model``'s CPU default), so drafting reads
  the head's weights with the same kernel, in bf16 (the file's precision)."""
  from specjax.drafters import methods
  from specjax.models import decoder, layers
  assert decoder.is_packed(smollm2.params)
  dparams = methods.build(smollm2, methods.MethodSpec("eagle3",
                                                      num_draft=2)).params
  assert isinstance(dparams.head["layer"]["wqkv"], layers.PackedWeight)
  assert dparams.head["lm_head"]["kernel"].panels.dtype == jnp.bfloat16


def test_grad_runs_through_the_kernels_and_keeps_tied_weights_tied():
  """Invariant: ``jax.grad`` of a loss over a packed model runs on the
  kernels' path (the FFI calls are in the program) and gives XLA's
  gradient (1e-4 relative, f32): over the packed params themselves (a
  packed weight's gradient is its plain gradient, packed), and over plain
  params packed inside the jit -- one pytree that both ``generate`` and
  ``jax.grad`` take, whose tied embedding gets both its uses' gradient."""
  from specjax import testing
  from specjax.core import bucketing, engine
  from specjax.models import decoder
  assert native.available(), "built with the package (setup.py)"
  cfg, params = testing.tiny("llama_gqa_tied", seed=3)
  assert cfg.tie_embeddings and params.lm_head is None
  tokens = jnp.asarray([[5, 17, 3, 9, 1, 30, 22, 8], [33, 4, 4, 12, 7, 2, 6,
                                                      19]], jnp.int32)

  def loss(p):  # the mean log-prob of each next token
    logits = decoder.forward(p, cfg, tokens, decoder.init_cache(
        cfg, 2, 16)).logits[:, :-1]
    return jnp.mean(jnp.take_along_axis(jax.nn.log_softmax(logits),
                                        tokens[:, 1:, None], -1))

  packed_loss = lambda p: loss(decoder.pack_params(p))
  assert "specjax_small_gemm" in str(jax.make_jaxpr(jax.grad(packed_loss))(
      params))
  assert "specjax_attention" in str(jax.make_jaxpr(packed_loss)(params))
  want = jax.grad(loss)(params)  # XLA's ops on the plain weights
  got = jax.jit(jax.grad(packed_loss))(params)
  close = lambda a, b: np.testing.assert_allclose(
      np.asarray(a), np.asarray(b), rtol=1e-4,
      atol=1e-4 * float(np.abs(np.asarray(b)).max()))
  jax.tree.map(close, got, want)
  # Over the packed params: each packed weight's gradient is packed.
  packed = decoder.pack_params(params)
  g = jax.grad(loss)(packed)
  close(g.layers[0].wqkv.panels, small_gemm.pack(want.layers[0].wqkv))

  @jax.jit
  def rollout_and_grad(p):  # the pytree generate and grad both take
    prompt, lengths = bucketing.pad_prompts([[5, 17, 3]])
    st = engine.generate(decoder.pack_params(p), prompt, lengths,
                         jax.random.key(0), 4, target=decoder.Decoder(cfg),
                         dcfg=engine.DecodeConfig(capacity=64))
    return st.tokens, jax.grad(packed_loss)(p)
  _, g2 = rollout_and_grad(params)
  jax.tree.map(close, g2, want)


@pytest.mark.parametrize("chunk,lengths", [(8, (7, 8, 9, 16, 17, 1)),
                                           (80, (79, 80, 81, 160, 161, 1))])
def test_packed_prefill_in_chunks_gives_one_forwards_logits(chunk, lengths):
  """Invariants on the native path (packed weights: the many-row matmul
  past 16 rows, the native attention over chunks, tasks of 16 tokens past
  64): ragged prompts of lengths around the chunk boundaries, scored chunk
  by chunk, give each row's last-token logits of one forward over the whole
  prompt and the same cache below each row's length (1e-5 of their
  scale); and one packed forward gives the plain (XLA) model's logits."""
  import dataclasses
  from specjax import testing
  from specjax.core import bucketing, engine
  from specjax.models import decoder
  cfg = dataclasses.replace(
      testing.CONFIGS["llama_gqa_tied"], vocab_size=64, dim=64, num_heads=4,
      num_kv_heads=2, head_dim=16, ffn_dim=96, max_position=512,
      name="chunks")
  params = testing.tiny_params(cfg, seed=1)
  rng = np.random.default_rng(chunk)
  prompt_BT, lens = bucketing.pad_prompts(
      [rng.integers(3, cfg.vocab_size, n).tolist() for n in lengths])
  target = decoder.Decoder(cfg)

  def score(p, c):
    cache = target.init_cache(p, len(lengths), prompt_BT.shape[1])
    return jax.jit(lambda p: engine._score_prompt(
        p, target, jnp.asarray(prompt_BT), jnp.asarray(lens), cache, (),
        c))(p)
  packed = decoder.pack_params(params)
  whole, chunked = score(packed, prompt_BT.shape[1]), score(packed, chunk)
  _assert_close(chunked.logits, whole.logits)
  _assert_close(whole.logits, score(params, prompt_BT.shape[1]).logits)
  for layer in range(cfg.num_layers):
    for row, n in enumerate(lengths):
      _assert_close(chunked.cache.k[layer][row, :, :, :n],
                    whole.cache.k[layer][row, :, :, :n])
      _assert_close(chunked.cache.v[layer][row, :, :n],
                    whole.cache.v[layer][row, :, :n])
