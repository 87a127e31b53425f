#!/usr/bin/env bash
# Builds llama.cpp's own `llama-server` for tests/test_llama_server_real.py, from the llama.cpp sources
# in llama-cpp-python's sdist, linked against the libraries of the llama-cpp-python wheel installed in
# the active Python (the same llama.cpp commit, built with the same options). Only the server's own
# files are compiled (16 of llama.cpp's ~220: 5 min on 2 cores at load average ~5, 13 at ~14), not
# all of llama.cpp.
#
#   .ci/build_llama_server.sh DEST     # -> DEST/bin/llama-server (and DEST/lib/*.so beside it)
#
# Needs cmake, ninja and a C++ compiler (cmake and ninja are on PyPI). An existing DEST/bin/llama-server
# is kept: DEST is a cache. Prints the binary's path last.
set -euo pipefail
VERSION=0.3.36  # llama-cpp-python, as .ci/run's engines stage installs it
DEST=$(realpath -m "${1:?usage: $0 DEST}")
PYTHON=${PYTHON:-python}
if [ -x "$DEST/bin/llama-server" ]; then
    echo "$DEST/bin/llama-server"
    exit 0
fi
# The installed wheel's libraries: libllama-common, libmtmd, libllama, libggml* (its top-level lib/).
LIBS=$("$PYTHON" - "$VERSION" <<'EOF'
import pathlib, sys
import llama_cpp
if llama_cpp.__version__ != sys.argv[1]:
    sys.exit(f"llama-cpp-python {llama_cpp.__version__} is installed; this script builds against {sys.argv[1]}")
print(pathlib.Path(llama_cpp.__file__).resolve().parent.parent / "lib")
EOF
)
[ -f "$LIBS/libllama-common.so" ] || { echo "no libllama-common.so in $LIBS" >&2; exit 1; }
for tool in cmake ninja; do
    command -v "$tool" >/dev/null || "$PYTHON" -m pip install -q "$tool"
done
# The build folder stays until the binary is made: an interrupted build resumes where it stopped.
WORK="$DEST/build"
mkdir -p "$WORK"
if [ ! -d "$WORK/llama_cpp_python-$VERSION" ]; then
    "$PYTHON" -m pip download -q --no-binary :all: --no-deps -d "$WORK" "llama-cpp-python==$VERSION"
    tar xzf "$WORK/llama_cpp_python-$VERSION.tar.gz" -C "$WORK"
fi
# The wheel's build options (llama-cpp-python's CMakeLists: shared libraries, common built, no curl;
# OpenSSL found), so that the server's objects agree with the libraries they are linked to. No web UI:
# its prebuilt assets would be downloaded.
cmake -S "$WORK/llama_cpp_python-$VERSION/vendor/llama.cpp" -B "$WORK/build" -G Ninja \
    -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DLLAMA_BUILD_COMMON=ON -DLLAMA_CURL=OFF \
    -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
    -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_BUILD_NUMBER=1 >"$WORK/configure.log"
cd "$WORK/build"
mapfile -t OBJECTS < <(ninja -t targets all \
    | grep -oE '^(tools/(server|ui)/[^:]+|common/CMakeFiles/llama-common-base\.dir/[^:]+)\.o' | sort -u)
nice -n 19 ninja -j "${JOBS:-2}" "${OBJECTS[@]}"
mkdir -p "$DEST/bin" "$DEST/lib"
cp -a "$LIBS"/*.so* "$DEST/lib/"
c++ -O3 "${OBJECTS[@]}" -o "$DEST/bin/llama-server.tmp" -L"$DEST/lib" -Wl,-rpath,'$ORIGIN/../lib' \
    -lllama-common -lmtmd -lllama -lggml -lggml-cpu -lggml-base -lssl -lcrypto -lpthread
"$DEST/bin/llama-server.tmp" --version >/dev/null 2>&1
mv "$DEST/bin/llama-server.tmp" "$DEST/bin/llama-server"
cd "$DEST" && rm -rf "$WORK"
echo "$DEST/bin/llama-server"
