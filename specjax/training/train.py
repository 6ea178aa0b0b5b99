"""Training an EAGLE-3 head: optax AdamW, orbax checkpoints, exact resume.

``train(cfg, workdir)`` is resumable: it restores the newest checkpoint in
``workdir/ckpt`` (params, optimizer state and step) and continues; the batch
at every step is a pure function of (seed, step) (``data.batch_indices``), so
an interrupted run continues with the very losses an uninterrupted one has.
Metrics go to ``workdir/metrics.jsonl`` (one line per logged step, appended,
the file is truncated back to the restored step on resume; ``tokens_per_s``
and ``elapsed_s`` count from the start of the process that logged them) and
the trained head to ``workdir/head.npz`` (``export.save_head``; rewritten at every
checkpoint, so an interrupted run leaves its newest head). ``config.json``
holds the config the run started with: a resume with another one is refused
unless asked for (``config_changes``), and every start appends what it ran
(code, versions, config, origin) to ``provenance.jsonl``. ``setup`` and
``restore_params`` rebuild a run's pieces for evaluation (``evaluate``).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import pathlib
import sys
import time
from typing import Any, Optional

import jax
import jax.numpy as jnp
import numpy as np
import optax

from specjax.core import sharding
from specjax.core.sampling import seed_key
from specjax.heads import FROZEN, head_module
from specjax.heads.base import HeadConfig, fuses_taps
from specjax.heads.export import save_head
from specjax.heads.vocab import DraftVocab, build_draft_vocab, draft_rows
from specjax.models.target import Target
from specjax.training import data as edata
from specjax.training.config import (ConfigChanged, OptimizerConfig,
                                     TrainConfig, config_changes)
from specjax.training.ttt import head_loss, loss_rows, target_batch


# The packages whose versions a run records.
_VERSIONED = ("specjax", "jax", "jaxlib", "flax", "optax", "orbax-checkpoint",
              "numpy")


def provenance() -> dict:
  """What this process runs: the time, the code (the commit of the git
  checkout specjax is imported from, and whether tracked files differ from
  it; None when specjax is not imported from a checkout), the package
  versions, Python and the devices."""
  import importlib.metadata
  import platform
  import subprocess
  root = pathlib.Path(__file__).resolve().parents[2]

  def git(*args):
    try:
      out = subprocess.run(["git", "-C", str(root), *args], timeout=30,
                           capture_output=True, text=True)
    except (OSError, subprocess.SubprocessError):
      return None
    return out.stdout.strip() if out.returncode == 0 else None

  commit = git("rev-parse", "HEAD") if (root / ".git").exists() else None
  code = None if commit is None else dict(commit=commit, dirty=bool(
      git("status", "--porcelain", "--untracked-files=no")))

  def version(name):
    try:
      return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
      return None

  device = jax.devices()[0]
  return dict(time=time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
              code=code, versions={n: version(n) for n in _VERSIONED},
              python=platform.python_version(),
              devices=dict(kind=device.device_kind, count=jax.device_count(),
                           processes=jax.process_count()))


def lr_at(ocfg: OptimizerConfig, count, total_steps):
  """Learning rate at optimizer step ``count``: linear warmup from 0 to
  ``lr`` over ``warmup`` steps, then a cosine down to ``lr *
  final_lr_fraction`` at ``total_steps``. ``total_steps`` may be traced: the
  run's length is data to the compiled step, so one compile serves runs of
  any length (``gpu_kit``'s timing probe and the run it sizes)."""
  warm = max(ocfg.warmup, 1)
  decay = jnp.maximum(total_steps, warm + 1) - warm
  t = jnp.clip(count - warm, 0, decay) / decay
  floor = ocfg.final_lr_fraction
  cosine = floor + (1 - floor) * 0.5 * (1 + jnp.cos(jnp.pi * t))
  return ocfg.lr * jnp.where(count < warm, count / warm, cosine)


def optimizer(ocfg: OptimizerConfig, variant: str, params, total_steps
              ) -> optax.GradientTransformation:
  """Clip -> AdamW(warmup-cosine over ``total_steps``); a ``variant``
  head's copies of target weights (``heads.FROZEN``) stay frozen. The
  state's structure does not depend on ``total_steps``."""
  train = optax.chain(optax.clip_by_global_norm(ocfg.clip_norm),
                      optax.adamw(lambda c: lr_at(ocfg, c, total_steps),
                                  b1=0.9, b2=ocfg.b2,
                                  weight_decay=ocfg.weight_decay))
  frozen = FROZEN[variant]
  labels = {k: ("frozen" if k in frozen else "train") for k in params}
  return optax.multi_transform(
      {"train": train, "frozen": optax.set_to_zero()}, labels)


def init_state(cfg: TrainConfig, params) -> dict:
  """``{"params", "opt"}``: a run's state before its first step."""
  opt = optimizer(cfg.optim, cfg.head.variant, params, cfg.steps)
  return {"params": params, "opt": opt.init(params)}


@functools.partial(jax.jit, static_argnames=("ocfg", "hcfg", "K", "rows",
                                             "cod_ratio"))
def train_step(state, batch, embed_VD, total_steps, key, *,
               ocfg: OptimizerConfig, hcfg: HeadConfig, K: int, rows: int,
               cod_ratio: float = 0.5):
  """One optimizer step, ``(state, loss, metrics, grad_norm)``, for TTT
  length ``K`` (a P-EAGLE head's depths, COD-sampled with ``key`` and
  ``cod_ratio``) over ``rows`` LM-head rows. Compiled once per process for
  each (shapes, ``ocfg``, ``hcfg``, K, rows): a second run with other
  ``steps`` or logging reuses the first one's program."""
  params = state["params"]
  (loss, m), g = jax.value_and_grad(
      lambda p: head_loss(p, hcfg, embed_VD, batch, K, rows=rows, key=key,
                          cod_ratio=cod_ratio),
      has_aux=True)(params)
  opt = optimizer(ocfg, hcfg.variant, params, total_steps)
  upd, opt_state = opt.update(g, state["opt"], params)
  return ({"params": optax.apply_updates(params, upd), "opt": opt_state},
          loss, m, optax.tree.norm(g))


def init_head(key, hcfg: HeadConfig, target: Target, target_params,
              vocab: DraftVocab):
  """Random init, then warm starts from the target: the LM head from the
  target's output rows of the draft vocabulary, and the target's final norm
  (EAGLE-3 and P-EAGLE: the head's output norm; EAGLE-1, Medusa: the
  feature norm; MTP: both)."""
  B, T = 1, 4
  params = head_module(hcfg).init(
      key, jnp.zeros((B, T, len(hcfg.taps) * hcfg.target_dim)),
      jnp.zeros((B, T), jnp.int32), target.embedding(target_params),
      jnp.zeros((B, T), jnp.int32))["params"]
  params = dict(params)
  params["lm_head"] = {
      "kernel": draft_rows(target.lm_head(target_params), vocab).T}
  norms = (("norm",) if fuses_taps(hcfg.variant) else
           ("feature_norm", "norm") if hcfg.variant == "mtp" else
           ("feature_norm",))
  try:
    scale_D, _ = target.output_norm(target_params)
  except NotImplementedError as e:
    if not fuses_taps(hcfg.variant):  # its feature *is* the target's norm
      raise ValueError(f"a {hcfg.variant} head needs the target's final "
                       f"RMSNorm: {e}") from None
    return params  # EAGLE-3's output norm starts at one instead
  for norm in norms:
    params[norm] = {"scale": scale_D.astype(params[norm]["scale"].dtype)}
  return params


def warm_layer(params, hcfg: HeadConfig, target: Target, target_params):
  """An EAGLE-3 head whose layer starts as the target's layer ``taps[-1]``
  (the one the high tap feeds): ``fc`` passes the high tap through, the
  feature half of q/k/v, the attention output and the MLP are that layer's
  weights, ``hidden_norm`` its input norm, and the embedding half of q/k/v
  is zero. The head's output then starts as the target's residual stream
  one layer past the high tap (after ``init_head``'s final norm and LM head:
  the target's logits read out there), and training has to learn to use the
  token it is given. The head's layer is the decoder's, so the weights are
  taken as they are."""
  if not hasattr(target, "layer_weights"):
    raise ValueError("init_layer=target needs a target whose layers can be "
                     "read (Target.layer_weights)")
  w = target.layer_weights(target_params, hcfg.taps[-1])
  D, mine = hcfg.target_dim, params["layer"]
  layer = {name: w[name] for name in mine}
  layer["wqkv"] = jnp.concatenate([jnp.zeros_like(w["wqkv"]), w["wqkv"]])
  for name, x in layer.items():
    if x.shape != mine[name].shape:
      raise ValueError(f"init_layer=target needs the head's layer shaped as "
                       f"the target's: {name} is {mine[name].shape} in the "
                       f"head, {x.shape} from the target")
  taps = len(hcfg.taps)
  fc = jnp.zeros((taps * D, D)).at[(taps - 1) * D:].set(jnp.eye(D))
  return {**params, "fc": {"kernel": fc},
          "hidden_norm": {"scale": w["attn_norm"]}, "layer": layer}


@dataclasses.dataclass
class Run:
  """What ``train`` returns: the final params, the per-step losses of this
  process, the pieces the run was built from (for scoring it), and why it
  stopped early if it did (``stopped``, empty otherwise)."""
  params: Any
  losses: dict
  step: int
  setup: "Setup"
  stopped: str = ""


@dataclasses.dataclass
class Setup:
  """What a run (or an evaluation of one) is built from: the frozen target,
  the train/held-out split, the draft vocabulary and the initial head."""
  model: Any
  train_ex: edata.Examples
  heldout_ex: edata.Examples
  vocab: DraftVocab
  hcfg: HeadConfig
  params: Any

  def features(self):
    """Jitted ``(target params, vocab, ids, mask) -> TTTBatch``. Target
    params and the vocabulary are arguments, not closed-over constants: XLA
    would otherwise fold 0.5 GB of weights into the program. One jit for the
    process (configs are static), so every evaluation reuses its compile."""
    tcfg, hcfg = self.model.target, self.hcfg
    return lambda tp, voc, tok, mask: _target_batch(tp, tcfg, hcfg, voc, tok,
                                                    mask)


_target_batch = jax.jit(target_batch, static_argnums=(1, 2))


def setup(cfg: TrainConfig, *, model=None,
          examples: Optional[edata.Examples] = None,
          progress: bool = True) -> Setup:
  """Loads the target (onto ``cfg.mesh`` if given) and data, builds Vd and
  the warm-started head."""
  from specjax.models.registry import load_model
  mesh = sharding.make_mesh(cfg.mesh) if cfg.mesh else None
  model = sharding.on_mesh(model or load_model(
      cfg.model, native=False if mesh else None), mesh)
  tcfg = model.config
  if examples is None:
    examples = edata.sharegpt_examples(model.tokenizer, cfg.data.num_conversations,
                                       cfg.data.max_len, progress=progress)
  train_ex, heldout_ex = edata.split(examples, cfg.data.heldout, cfg.seed)
  if cfg.data.regenerate:
    from specjax.core.sampling import SamplingParams
    from specjax.training.regenerate import regenerate
    rewrite = lambda ex: regenerate(
        model, ex, max_new_tokens=cfg.data.regen_max_new_tokens,
        sampling=SamplingParams(temperature=cfg.data.regen_temperature),
        seed=cfg.seed, progress=progress)
    train_ex = rewrite(train_ex.take(np.arange(min(cfg.data.regenerate,
                                                   len(train_ex)))))
    heldout_ex = rewrite(heldout_ex)
  if cfg.head.init_head:
    from specjax.heads.export import load_head
    from specjax.heads import with_shared
    hcfg, params, ids = load_head(cfg.head.init_head, tcfg)
    if (hcfg.variant, cfg.head.variant) == ("eagle3", "peagle"):
      hcfg, params = block_head(hcfg, params, _mask_token(cfg, tcfg),
                                cfg.ttt.steps, seed_key(cfg.seed))
    if hcfg.variant != cfg.head.variant:
      raise ValueError(f"init_head {cfg.head.init_head!r} is an {hcfg.variant} "
                       f"head; this run trains {cfg.head.variant}")
    params = with_shared(hcfg, params, model.target, model.params)
    return Setup(model, train_ex, heldout_ex,
                 DraftVocab.from_ids(ids, tcfg.vocab_size), hcfg, params)
  vd = (tcfg.vocab_size if cfg.head.variant in ("eagle1", "mtp")
        else cfg.head.draft_vocab)
  vocab = build_draft_vocab(
      (r[m] for r, m in zip(train_ex.ids, train_ex.mask)), tcfg.vocab_size,
      min(vd, tcfg.vocab_size), always=tcfg.eos_ids)
  extra = (dict(medusa_heads=cfg.head.medusa_heads)
           if cfg.head.variant == "medusa" else
           dict(mask_token=_mask_token(cfg, tcfg), block_depths=cfg.ttt.steps)
           if cfg.head.variant == "peagle" else {})
  hcfg = HeadConfig.for_target(tcfg, vocab.size, variant=cfg.head.variant,
                               **extra)
  params = init_head(seed_key(cfg.seed), hcfg, model.target,
                     model.params, vocab)
  if cfg.head.init_layer == "target":
    params = warm_layer(params, hcfg, model.target, model.params)
  return Setup(model, train_ex, heldout_ex, vocab, hcfg, params)


def _mask_token(cfg: TrainConfig, tcfg) -> int:
  """A P-EAGLE head's placeholder: ``head.mask_token``, or the target's
  last token id."""
  return cfg.head.mask_token if cfg.head.mask_token >= 0 else (
      tcfg.vocab_size - 1)


def block_head(hcfg: HeadConfig, params, mask_token: int, depths: int, key):
  """An EAGLE-3 head as a P-EAGLE head to train on ``depths`` depths: its
  parameters as they are (slot 0 is EAGLE-3's pair) and a fresh
  ``mask_hidden``."""
  hcfg = dataclasses.replace(hcfg, variant="peagle", mask_token=mask_token,
                             block_depths=depths)
  width = len(hcfg.taps) * hcfg.target_dim
  return hcfg, dict(params, mask_hidden=0.02 * jax.random.normal(
      key, (width,), jnp.float32))


def trained_examples(cfg: TrainConfig, train_ex: edata.Examples
                     ) -> edata.Examples:
  """The rows the run's batches are drawn from: the whole training split,
  or with ``feature_cache = N`` its first N (the cached ones)."""
  if not cfg.data.feature_cache:
    return train_ex
  return train_ex.take(np.arange(min(cfg.data.feature_cache, len(train_ex))))


def checkpoints(workdir) -> "ocp.CheckpointManager":
  """The run's orbax manager (``workdir/ckpt``), for reading saved steps."""
  import orbax.checkpoint as ocp
  return ocp.CheckpointManager(pathlib.Path(workdir).absolute() / "ckpt")


def _restore(mngr, step: int, like):
  """The state saved at ``step``, shaped like ``like`` (and laid out like
  it: a checkpoint restores onto whatever mesh ``like`` lives on). Raises
  ValueError naming the checkpoint when it does not fit ``like`` or cannot
  be read."""
  import orbax.checkpoint as ocp
  try:
    return mngr.restore(step, args=ocp.args.StandardRestore(
        jax.tree.map(ocp.utils.to_shape_dtype_struct, like)))
  except (ValueError, KeyError, TypeError, OSError) as e:
    where = pathlib.Path(mngr.directory) / str(step)
    first = str(e).strip().splitlines()[0] if str(e).strip() else repr(e)
    raise ValueError(f"checkpoint {str(where)!r} does not fit this run (a "
                     f"different head or optimizer, or damaged): {first[:300]}"
                     ) from None


def restore_params(workdir, step: int, s: Setup, cfg: TrainConfig):
  """The head params saved at ``step`` in ``workdir``."""
  like = init_state(cfg, s.params)
  return _restore(checkpoints(workdir), step, like)["params"]


def train(cfg: TrainConfig, workdir: str, *, model=None,
          examples: Optional[edata.Examples] = None, stop_after: Optional[int]
          = None, deadline: Optional[float] = None, progress: bool = True,
          allow_config_change: bool = False, origin: Optional[dict] = None
          ) -> Run:
  """Trains (or resumes) a head; see the module doc.

  A resume whose ``cfg`` differs from the run's (``config_changes``)
  raises ``ConfigChanged`` before anything runs, unless
  ``allow_config_change``: then ``config.json`` becomes ``cfg``. Every
  start appends a line to ``workdir/provenance.jsonl``: the step it
  starts from, the config, the fields it changed, ``provenance()`` and
  ``origin`` (the CLI's: the config file, its digest and the overrides).

  ``model``/``examples`` override loading (tests); ``stop_after`` ends the
  process-level run early at that step, as an interruption would.
  ``deadline`` (a ``time.time()``) ends it after the first step that
  finishes past it, with a checkpoint there (if ``checkpoint_every``), so
  a rerun goes on from it. A step whose loss is not finite ends the run
  before that step: the head of the last finite step is exported and
  ``Run.stopped`` says why (no checkpoint: a resume would diverge again at
  the same step).
  """
  import orbax.checkpoint as ocp
  from tqdm.auto import tqdm

  work = pathlib.Path(workdir).absolute()
  lead = jax.process_index() == 0  # the process that writes files
  work.mkdir(parents=True, exist_ok=True)
  changes = config_changes(cfg, work)
  if changes and not allow_config_change:
    raise ConfigChanged(work, changes)
  if lead:
    _write_atomic(work / "config.json",
                  json.dumps(dataclasses.asdict(cfg), indent=1))
  s = setup(cfg, model=model, examples=examples, progress=progress)
  state = init_state(cfg, s.params)
  mesh = s.model.mesh
  if mesh is not None:  # data-parallel: every device holds the whole head
    state = sharding.replicate(state, mesh)
  mngr = ocp.CheckpointManager(
      work / "ckpt", options=ocp.CheckpointManagerOptions(max_to_keep=cfg.keep))
  start = 0
  if mngr.latest_step() is not None:
    start = mngr.latest_step()
    state = _restore(mngr, start, state)
  metrics_path = work / "metrics.jsonl"
  if lead:
    _truncate_metrics(metrics_path, start)
    _append_lines(work / "provenance.jsonl", [json.dumps(dict(
        start_step=start, config=dataclasses.asdict(cfg), changed=changes,
        **(origin or {}), **provenance()))])
  train_ex, get_batch = _batches(cfg, s, work, progress)

  losses, stopped = {}, ""
  end = cfg.steps if stop_after is None else min(cfg.steps, stop_after)
  bar = tqdm(range(start, end), initial=start, total=cfg.steps, desc="train",
             disable=not progress)
  tokens_seen, t0 = 0, time.perf_counter()
  for step in bar:
    idx = edata.batch_indices(step, len(train_ex), cfg.batch_size, cfg.seed)
    ex = train_ex.take(idx)
    # One compile per (TTT length or Medusa depths, bucket of assistant
    # positions).
    K = s.hcfg.medusa_heads or cfg.ttt_at(step)
    rows = loss_rows(ex.mask, cfg.batch_size * cfg.ttt.rows_bucket)
    batch = get_batch(idx, ex)
    if mesh is not None:  # rows over the data axis
      batch = sharding.shard_batch(batch, mesh)
    embed_VD = s.model.target.embedding(s.model.params)
    # The step's own key (COD's depths): a resume draws the same ones.
    key = jax.random.fold_in(seed_key(cfg.seed), step)
    new, loss, m, gnorm = train_step(state, batch, embed_VD,
                                     np.int32(cfg.steps), key, ocfg=cfg.optim,
                                     hcfg=s.hcfg, K=K, rows=rows,
                                     cod_ratio=cfg.head.cod_ratio)
    loss = float(sharding.to_host(loss))  # the one sync a step needs
    if not applies(loss):
      end, stopped = step, f"non-finite loss at step {step + 1}"
      print(f"specjax: warning: {stopped}; the head of step {step} is kept",
            file=sys.stderr)
      break
    state, losses[step] = new, loss
    tokens_seen += int(ex.lengths.sum())
    timed_out = (deadline is not None and time.time() >= deadline
                 and step + 1 < end)
    if timed_out:
      end = step + 1
    if (step + 1) % cfg.log_every == 0 or step + 1 == end:
      m, gnorm = sharding.to_host((m, gnorm))
      acc = [round(float(a), 4) for a in m["acc"]]
      elapsed = time.perf_counter() - t0
      rec = dict(step=step + 1, loss=round(losses[step], 5), acc=acc,
                 ttt=K, grad_norm=round(float(gnorm), 4),
                 tokens_per_s=round(tokens_seen / elapsed, 1),
                 elapsed_s=round(elapsed, 2))
      if lead:
        with open(metrics_path, "a") as f:
          f.write(json.dumps(rec) + "\n")
      bar.set_postfix(loss=f"{losses[step]:.3f}",
                      acc="/".join(f"{a:.2f}" for a in acc[:3]))
    if cfg.checkpoint_every and ((step + 1) % cfg.checkpoint_every == 0
                                 or step + 1 == cfg.steps or timed_out):
      mngr.save(step + 1, args=ocp.args.StandardSave(state))
      if step + 1 < end and lead:  # an interrupted run still leaves a head
        save_head(work / "head.npz", s.hcfg, sharding.to_host(state["params"]),
                  s.vocab.ids)
    if step + 1 == end:
      break
  mngr.wait_until_finished()
  # The head as one portable file, usable by `--method eagle3 --head`.
  if lead:
    head = sharding.to_host(state["params"])
    save_head(work / "head.npz", s.hcfg, head, s.vocab.ids)
    from specjax.heads.export import export_layout
    for fmt in filter(None, cfg.export.split(",")):
      export_layout(work / f"head-{fmt}", s.hcfg, head, s.vocab.ids, fmt,
                    target_name=cfg.model)
  return Run(params=state["params"], losses=losses, step=end, setup=s,
             stopped=stopped)


def _batches(cfg: TrainConfig, s: Setup, work: pathlib.Path, progress: bool):
  """``(rows trained on, (idx, examples) -> TTTBatch)``: the target run on
  the fly, or (``feature_cache``) read from the features cached in ``work``."""
  if not cfg.data.feature_cache:
    features = s.features()
    return s.train_ex, lambda idx, ex: features(s.model.params, s.vocab,
                                                ex.ids, ex.mask)
  from specjax.training import features as efeat
  train_ex = trained_examples(cfg, s.train_ex)
  cache = efeat.build(s.model, cfg.model, s.hcfg, s.vocab, train_ex,
                      work / "features", progress=progress)
  out_VdD = draft_rows(s.model.target.lm_head(s.model.params), s.vocab)
  cap = getattr(s.model.config, "final_logit_cap", None)
  return train_ex, lambda idx, ex: efeat.cached_batch(cache, out_VdD, idx,
                                                      train_ex, cap)


def applies(loss: float) -> bool:
  """Whether a step's update is kept: only when its loss is finite."""
  return bool(np.isfinite(loss))


def _truncate_metrics(path: pathlib.Path, step: int) -> None:
  """Keeps the metric lines up to the restored step; the lines past it
  (they will be redone) and torn ones (a kill mid-write) move to
  ``metrics.dropped.jsonl`` beside it, so a rerun loses nothing."""
  if not path.is_file():
    return

  def kept(line: str) -> bool:
    try:
      return json.loads(line)["step"] <= step
    except (ValueError, KeyError, TypeError):
      return False

  lines = [l for l in path.read_text(errors="replace").splitlines()
           if l.strip()]
  dropped = [l for l in lines if not kept(l)]
  if dropped:
    _append_lines(path.with_name("metrics.dropped.jsonl"), dropped)
  # Replaced, not rewritten in place: a kill mid-rewrite would lose the
  # lines it keeps (tests/test_kills.py).
  _write_atomic(path, "".join(l + "\n" for l in lines if kept(l)))


def _append_lines(path: pathlib.Path, lines: list[str]) -> None:
  """Appends ``lines``, first ending a torn last line (a kill mid-append)
  so that the first of them stays a line of its own."""
  text = "".join(l + "\n" for l in lines).encode()
  with open(path, "ab+") as f:
    if f.seek(0, 2):
      f.seek(-1, 2)
      if f.read(1) != b"\n":
        text = b"\n" + text
    f.write(text)


def _write_atomic(path: pathlib.Path, text: str) -> None:
  """``text`` into ``path`` through a synced temporary beside it and
  ``os.replace``: a kill mid-write leaves the old file whole, never a torn
  one."""
  tmp = path.with_name(path.name + ".tmp")
  with open(tmp, "w") as f:
    f.write(text)
    f.flush()
    os.fsync(f.fileno())
  os.replace(tmp, path)
