#!/bin/bash
# The wheels a GPU machine's image lacks for vserve's benchmarks (its image: torch, triton, transformers 5.17, hub,
# tokenizers, safetensors, peft, typer, rich, uvloop ...), fetched here into .whl/ (git-ignored) for the device
# tool to carry, with the SmolLM2 tokenizer the structured rows use (.whl/smoltok, from the embedded model's cache).
#   bash benchmarks/device/fetch_wheels.sh        # then: run(..., carry=[".whl"], "bash benchmarks/device/run.sh MODE")
set -euo pipefail
cd "$(dirname "$0")/../.."
mkdir -p .whl .whl/smoltok
P="--no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_31_x86_64
   --platform manylinux_2_28_x86_64
   --platform manylinux_2_27_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 -d .whl"
for pkg in fastapi starlette uvicorn pydantic pydantic_core annotated-types typing-inspection typing_extensions \
           annotated-doc opentelemetry-api sniffio xgrammar apache-tvm-ffi gguf llguidance; do
  v=$(.venv/bin/pip show "$pkg" 2>/dev/null | awk '/^Version/{print $2}')  # the versions the tests run with
  python3 -m pip download -q $P "$pkg${v:+==$v}" 2>&1 | grep -v "^WARNING" || true
done
# pyproject's lowest transformers: it loads tokenizers without torch and works with the image's huggingface-hub 1.33
# (later ones want hub >= 2.4 and the `kernels` package)
python3 -m pip download -q $P transformers==5.18.0 2>&1 | grep -v "^WARNING" || true
# gemlite (pure Triton low-bit GEMMs; #31 times it beside the W4A16 kernels): an sdist only, built into a wheel here
python3 -m pip wheel -q --no-deps gemlite==0.6.0.post2 -w .whl 2>&1 | grep -v "^WARNING" || true
tok=$(ls -d "${VSERVE_CACHE:-$HOME/.cache/vserve}"/SmolLM2-135M-Instruct-* | head -1)
cp "$tok"/tokenizer.json "$tok"/tokenizer_config.json "$tok"/chat_template.jinja .whl/smoltok/
git rev-parse --short HEAD > .whl/REV
du -sh .whl
