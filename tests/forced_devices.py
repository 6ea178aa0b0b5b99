"""A worker module run on forced host devices, in its own process (JAX
fixes the device count when it starts): ``python -m MODULE ARGS`` with
``--xla_force_host_platform_device_count``, its last stdout line read as
JSON."""

import json
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def run_worker(module: str, num_devices: int, *args) -> dict:
  env = dict(os.environ,
             XLA_FLAGS=os.environ.get("XLA_FLAGS", "")
             + f" --xla_force_host_platform_device_count={num_devices}")
  proc = subprocess.run([sys.executable, "-m", module, *map(str, args)],
                        cwd=ROOT, env=env, capture_output=True, text=True,
                        timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  return json.loads(proc.stdout.strip().splitlines()[-1])
