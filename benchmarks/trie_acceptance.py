"""τ of the n-gram drafter's chain and tries at T = 0, replayed offline on
greedy output (the aim: tries reach the chain's τ + 0.2).

  .venv/bin/python -m benchmarks.trie_acceptance --dataset mtbench
  .venv/bin/python -m benchmarks.trie_acceptance --dataset humaneval

At T = 0 speculative decoding emits exactly the greedy tokens, so a table
drafter's acceptance needs no verify forwards: decode every prompt greedily
once (AR, batched; cached in ``runs/greedy_<dataset><prompts>.json``), then
walk each output as the engine would — draft from the committed tokens, accept the
longest drafted path that matches the greedy continuation, emit it plus one
token — with the real jitted drafter and trie code. Prints one JSON line:
τ (emitted tokens per verify, as ``specjax bench`` counts it) per variant:
the n-gram chain at K, n-gram's trie of P matches cut to N nodes (as the
engine builds it) and the trie of n-gram's P paths and retrieval's
(``ngram+retrieval``, ``drafters.LookupDrafter``).
"""

from __future__ import annotations

import argparse
import json
import pathlib
import sys

import numpy as np

ROOT = pathlib.Path(__file__).resolve().parents[1]


def greedy_outputs(model, ids, max_new_tokens: int, path: pathlib.Path,
                   batch: int = 8) -> list[list[int]]:
  """Each prompt's greedy output (cached in ``path``)."""
  if path.is_file():
    return json.loads(path.read_text())
  from specjax.core import runner
  out = []
  for i in range(0, len(ids), batch):
    res = runner.generate_ids(model, ids[i:i + batch],
                              max_new_tokens=max_new_tokens)
    out += [r.output_ids for r in res.rows]
  path.parent.mkdir(parents=True, exist_ok=True)
  path.write_text(json.dumps(out))
  return out


def accepted(tokens, parents, valid, truth) -> int:
  """How many of ``truth`` the tree's deepest matching path covers."""
  node, depth = 0, 0
  while depth < len(truth):
    kids = [m for m in range(1, len(tokens)) if valid[m] and
            parents[m] == node and tokens[m] == truth[depth]]
    if not kids:
      break
    node, depth = kids[0], depth + 1
  return depth


def replay(prompt, output, propose, K: int, S: int) -> tuple[int, int]:
  """(emitted tokens after the first, verify steps) for one prompt."""
  seq = np.zeros((1, S), np.int32)
  full = list(prompt) + list(output)
  seq[0, :len(full)] = full
  j, steps = 1, 0
  while j < len(output):
    n = len(prompt) + j
    truth = output[j:j + K]
    ctx = seq.copy()
    ctx[0, n:] = 0
    j += propose(ctx, n, truth) + 1
    steps += 1
  return len(output) - 1, steps


def main(argv=None) -> int:
  ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  ap.add_argument("--dataset", default="mtbench")
  ap.add_argument("--num-prompts", type=int, default=None)
  ap.add_argument("--max-new-tokens", type=int, default=128)
  ap.add_argument("--k", type=int, default=5)
  ap.add_argument("--nodes", default="8,12,16")
  ap.add_argument("--paths", default="4,8")
  ap.add_argument("--only", default="",
                  help="run only the variants whose names contain this")
  args = ap.parse_args(argv)

  import jax
  import jax.numpy as jnp
  from benchmarks.common import machine
  from specjax import data
  from specjax.drafters import Context, LookupDrafter, NGramDrafter
  from specjax.drafters import methods
  from specjax.drafters.methods import MethodSpec
  from specjax.measure import bench
  from specjax.models.registry import load_model

  model = load_model("smollm2-135m")
  prompts = data.load_prompts(args.dataset, args.num_prompts)
  chat = args.dataset != "humaneval"
  ids = [model.tokenizer.encode_chat(p) if chat else model.tokenizer.encode(p)
         for p in prompts]
  cached = ROOT / "runs" / f"greedy_{args.dataset}{len(ids)}.json"
  outs = greedy_outputs(model, ids, args.max_new_tokens, cached)
  S = max(len(p) + len(o) for p, o in zip(ids, outs)) + 1
  K = args.k

  store = methods.build(model, MethodSpec("retrieval", num_draft=K)).params

  def replayed(draft, tree: bool):
    """``propose(ctx, n, truth)`` -> accepted drafts, for a jitted
    ``draft(tokens, num_tokens)`` that returns a Proposal or a Tree."""
    fn = jax.jit(draft)

    def propose(ctx, num, truth):
      out = fn(jnp.asarray(ctx), jnp.asarray([num], jnp.int32))
      if tree:
        return accepted(np.asarray(out.tokens[0]), np.asarray(out.parents[0]),
                        np.asarray(out.valid[0]), truth)
      d = np.asarray(out.tokens[0])[:int(out.num_drafted[0])]
      a = 0
      while a < min(len(d), len(truth)) and d[a] == truth[a]:
        a += 1
      return a
    return propose

  def chain(drafter, params):
    return replayed(lambda t, num: drafter.propose(
        params, None, Context(t, num), None, K, None), tree=False)

  def tried(drafter, params, nodes):
    return replayed(lambda t, num: drafter.propose_tree(
        params, None, Context(t, num), None, K, nodes, None).tree, tree=True)

  variants = {f"n-gram chain K={K}": chain(NGramDrafter(), None),
              f"ngram+retrieval chain K={K}": chain(LookupDrafter(), store)}
  for P in map(int, args.paths.split(",")):
    for N in map(int, args.nodes.split(",")):
      variants[f"n-gram trie P={P} N={N}"] = tried(
          NGramDrafter(num_paths=P), None, N)
      variants[f"ngram+retrieval trie P={P} N={N}"] = tried(
          LookupDrafter(ngram=NGramDrafter(num_paths=P)), store, N)
  out = dict(dataset=args.dataset, prompts=len(ids), k=K,
             git_sha=bench.git_sha(), machine=machine(), tau={})
  for name, propose in variants.items():
    if args.only not in name:
      continue
    emitted = steps = 0
    for p, o in zip(ids, outs):
      e, s = replay(p, o, propose, K, S)
      emitted, steps = emitted + e, steps + s
    out["tau"][name] = round(emitted / max(steps, 1), 4)
    print(name, out["tau"][name], file=sys.stderr, flush=True)
  print(json.dumps(out))
  return 0


if __name__ == "__main__":
  sys.exit(main())
