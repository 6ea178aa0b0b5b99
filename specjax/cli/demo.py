"""The README's main job: SmolLM2-135M-Instruct decoding on this machine.

Streams one answer token by token (the jitted step driven from Python),
decodes a ragged batch in one ``lax.while_loop`` call and reports tokens/s,
then decodes input-grounded prompts (edit / reformat a given text, where
prompt lookup shines) with n-gram speculative decoding and AR side by side:
identical greedy tokens, τ and the measured speedup.
"""

from __future__ import annotations

import sys

import jax
import numpy as np

from specjax.core import bucketing, engine, runner
from specjax.core.sampling import SamplingParams
from specjax.models.registry import Model
from specjax.models.tokenizer import StreamDecoder

PROMPTS = (
    "Write a Python function that checks whether a number is prime.",
    "Explain in two sentences why the sky is blue.",
    "Give me three tips for writing clear emails.",
    "What is 17 times 23?",
)
# Answers that copy long spans of their prompt: prompt lookup's home ground.
GROUNDED = (
    "Fix the spelling mistakes in this text and return the whole corrected "
    "text: 'The quick brown fox jumpd over the lazy dog. Then the fox ran "
    "into the forrest, where it found a smal river and drank some watter "
    "before going home to it's den.'",
    "Rewrite this list as a numbered list, keeping every item: apples, "
    "bananas, cherries, dates, elderberries, figs, grapes, honeydew melon, "
    "kiwis, lemons.",
)


def run(model: Model, max_new_tokens: int = 96) -> None:
  say = lambda *a: print(*a, flush=True)
  say(f"{model.config.name}: {model.config.num_layers} layers, "
      f"D={model.config.dim}, V={model.config.vocab_size}, "
      f"backend {jax.default_backend()}")

  ids = [model.tokenizer.encode_chat(p) for p in PROMPTS]
  say(f"\n>>> {PROMPTS[0]}")
  prompt_BT, lengths = bucketing.pad_prompts(ids[:1])
  dcfg = runner.decode_config(model, prompt_BT.shape[1], max_new_tokens,
                              SamplingParams())
  detok, shown = StreamDecoder(model.tokenizer, skip_special_tokens=True), 0
  for state in engine.stream(model.params, prompt_BT, lengths,
                             jax.random.key(0), np.int32(max_new_tokens),
                             target=model.target, dcfg=dcfg):
    n = int(state.num_tokens[0])
    sys.stdout.write(detok.push(state.tokens[0, lengths[0] + shown:n].tolist()))
    sys.stdout.flush()
    shown = n - lengths[0]
  say(detok.flush())

  say(f"\nbatch of {len(PROMPTS)} prompts ({', '.join(str(len(i)) for i in ids)}"
      f" tokens), greedy, up to {max_new_tokens} new tokens each:")
  res = runner.generate_ids(model, ids, max_new_tokens=max_new_tokens)
  for prompt, row in zip(PROMPTS, res.rows):
    text = model.tokenizer.decode(row.output_ids, skip_special_tokens=True)
    say(f"\n>>> {prompt}\n{text.strip()}  [{len(row.output_ids)} tokens, "
        f"{row.stop_reason}]")
  say(f"\n{res.new_tokens} tokens in {res.wall_s:.2f} s "
      f"(+ {res.compile_s:.1f} s one-off compile) = "
      f"{res.new_tokens / res.wall_s:.1f} tokens/s "
      f"({res.num_steps + 1} batched steps, "
      f"{res.wall_s / (res.num_steps + 1) * 1e3:.1f} ms/step)")
  speculative(model, max_new_tokens=2 * max_new_tokens)


SPEC_K = 4  # the speculative part's K


def max_new_tokens_limit(model: Model) -> int:
  """The largest ``max_new_tokens`` whose every part fits the context: the
  batch's prompts plus it, the grounded prompts plus twice it and a verify
  block."""
  ctx = model.config.max_position
  chat = lambda prompts: max(len(model.tokenizer.encode_chat(p))
                             for p in prompts)
  return min(ctx - chat(PROMPTS),
             (ctx - chat(GROUNDED) - SPEC_K - 1) // 2)


def speculative(model: Model, max_new_tokens: int,
                num_draft: int = SPEC_K) -> None:
  """n-gram prompt lookup vs AR on the grounded prompts, one at a time."""
  from specjax.drafters import Method, NGramDrafter
  say = lambda *a: print(*a, flush=True)
  say(f"\nspeculative decoding, n-gram prompt lookup (K={num_draft}) vs AR, "
      f"greedy, batch 1, up to {max_new_tokens} new tokens:")
  ar_s = spec_s = 0.0
  for prompt in GROUNDED:
    ids = [model.tokenizer.encode_chat(prompt)]
    ar = runner.generate_ids(model, ids, max_new_tokens=max_new_tokens)
    spec = runner.generate_ids(model, ids, max_new_tokens=max_new_tokens,
                               method=Method(NGramDrafter(),
                                             num_draft=num_draft))
    row = spec.rows[0]
    same = row.output_ids == ar.rows[0].output_ids
    text = model.tokenizer.decode(row.output_ids, skip_special_tokens=True)
    say(f"\n>>> {prompt}\n{text.strip()}\n  [{len(row.output_ids)} tokens; "
        f"identical to AR: {'yes' if same else 'NO'}; tau {row.tau:.2f} "
        f"tokens/verify; accepted per draft position {row.accepted_at} of "
        f"{row.target_forwards} verifies; {ar.wall_s / spec.wall_s:.2f}x AR]")
    ar_s, spec_s = ar_s + ar.wall_s, spec_s + spec.wall_s
  say(f"\nspeculative vs AR, same prompts, same run: {ar_s / spec_s:.2f}x "
      f"({ar_s:.2f} s -> {spec_s:.2f} s)")
