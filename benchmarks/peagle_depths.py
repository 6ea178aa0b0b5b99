"""A P-EAGLE head's greedy accuracy by depth on the target's own greedy text,
in training's layout: what its block drafts well, apart from decoding.

  .venv/bin/python -m benchmarks.peagle_depths --head runs/pe/head.npz \
      --num-prompts 20 --depths 4

The target continues each prompt greedily (``--max-new-tokens``); the head
then runs once over each sequence with every position as an anchor at every
depth (``ttt.cod_layout`` at ratio 1, ``ttt.peagle_outputs``), and entry
(t, d)'s greedy draft is compared with x[t + 2 + d], for drafts inside the
continuation. Prints one JSON line: per depth the share right
(``unconditional``), the share right where every depth before it at the
same anchor was right too (``given_before``: what a chain's verification
sees), their product (``by_position``: the acceptance by position a chain
of this head reaches at T = 0) and the counts.
"""

from __future__ import annotations

import argparse

import jax
import jax.numpy as jnp
import numpy as np


def depth_hits(head, cfg, embed, batch, ids, prompt_len: int, depths: int):
  """``{(t, d): right}`` for one sequence (``batch`` of one row)."""
  from specjax.heads import head_call
  from specjax.training import ttt
  T = batch.tokens.shape[1]
  lay = ttt.cod_layout(jax.random.key(0), 1, T, depths, 1.0)
  out = ttt.peagle_outputs(head, cfg, embed, batch, lay)
  logits = np.asarray(head_call(cfg, head)("logits", out))[0]
  draft = np.asarray(ids)[logits.argmax(-1)]
  seq = np.asarray(batch.tokens)[0]
  hits = {}
  for e, (t, d) in enumerate(zip(np.asarray(lay.anchor)[0],
                                 np.asarray(lay.depth))):
    j = int(t) + 2 + int(d)  # the token entry (t, d) drafts
    if t + 2 >= prompt_len and j < T:
      hits[int(t), int(d)] = bool(draft[e] == seq[j])
  return hits


def main(argv=None):
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--head", required=True)
  ap.add_argument("--dataset", default="mtbench")
  ap.add_argument("--num-prompts", type=int, default=20)
  ap.add_argument("--max-new-tokens", type=int, default=96)
  ap.add_argument("--depths", type=int, default=4)
  args = ap.parse_args(argv)
  from benchmarks.common import emit, machine
  from specjax import data
  from specjax.core import runner
  from specjax.heads import with_shared
  from specjax.heads.export import load_head
  from specjax.heads.vocab import DraftVocab
  from specjax.measure.bench import git_sha
  from specjax.models.registry import load_model
  from specjax.training import ttt
  model = load_model("smollm2-135m", native=False)
  cfg, head, ids = load_head(args.head, model.config)
  if cfg.variant != "peagle":
    raise SystemExit(f"peagle_depths: {args.head} is a {cfg.variant} head")
  head = with_shared(cfg, head, model.target, model.params)
  vocab = DraftVocab.from_ids(ids, model.config.vocab_size)
  chat = args.dataset != "humaneval"
  prompts = [model.tokenizer.encode_chat(p) if chat
             else model.tokenizer.encode(p)
             for p in data.load_prompts(args.dataset, args.num_prompts)]
  rows = runner.generate_ids(model, prompts,
                             max_new_tokens=args.max_new_tokens).rows
  D = args.depths
  right, seen, chained, chain_seen = (np.zeros(D) for _ in range(4))
  for r in rows:
    seq = jnp.asarray([r.prompt_ids + r.output_ids], jnp.int32)
    batch = ttt.target_batch(model.params, model.target, cfg, vocab, seq,
                             np.ones(seq.shape, bool))
    hits = depth_hits(head, cfg, model.target.embedding(model.params), batch,
                      ids, len(r.prompt_ids), D)
    for (t, d), ok in hits.items():
      right[d] += ok
      seen[d] += 1
      if all(hits.get((t, e), False) for e in range(d)):
        chained[d] += ok
        chain_seen[d] += 1
  given = chained / np.maximum(chain_seen, 1)
  emit(dict(head=args.head, dataset=args.dataset,
            num_prompts=len(rows), depths=D, block_depths=cfg.block_depths,
            unconditional=np.round(right / np.maximum(seen, 1), 4).tolist(),
            given_before=np.round(given, 4).tolist(),
            by_position=np.round(np.cumprod(given), 4).tolist(),
            counts=seen.astype(int).tolist(),
            counts_given_before=chain_seen.astype(int).tolist(),
            git_sha=git_sha(), machine=machine()))


if __name__ == "__main__":
  main()
