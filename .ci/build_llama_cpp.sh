#!/usr/bin/env bash
# Builds, once per machine, what the real-engine slow tests run: llama-cpp-python's wheel (CPU only) and
# llama.cpp's own `llama-server`, both from the llama.cpp sources in llama-cpp-python's sdist.
#
#   .ci/build_llama_cpp.sh DEST    # -> DEST/wheels/llama_cpp_python-*.whl, DEST/bin/llama-server
#
# llama.cpp is compiled once, in the wheel (its libraries: ggml, llama, llama-common, mtmd); llama-server
# is then only its own files, compiled in a second build tree from the same sources and linked against
# the wheel's libraries (the same commit, built with the same options). DEST is a cache: what is there
# is kept, and a second run prints the two paths at once. Each compile prints a `[n/N]` line, so a long
# build shows where it is; the full output is in DEST/build/*.log until the build is done.
#
# Prints the wheel's path, then the server's (last). Needs cmake, ninja and a C++ compiler (cmake and
# ninja are on PyPI). JOBS sets the parallel compiles (default: the number of cores).
set -euo pipefail
VERSION=0.3.36  # llama-cpp-python, as .ci/run's engines stage installs it
DEST=$(realpath -m "${1:?usage: $0 DEST}")
PYTHON=${PYTHON:-python}
JOBS=${JOBS:-$(nproc)}
WORK="$DEST/build"  # kept until both are built: an interrupted build resumes where it stopped
SRC="$WORK/llama_cpp_python-$VERSION"

# One line per file from a build's output, ninja's `[n/N]` and the file made (the verbose command
# lines that the wheel's build prints are cut to their -o), all of it to the log.
progress() {
    tee -a "$1" | sed -unE -e 's/^ *(\[[0-9]+\/[0-9]+\]) .* -o ([^ ]+) .*/\1 \2/p;t' \
        -e 's/^ *(\[[0-9]+\/[0-9]+\] .{0,100}).*/\1/p' >&2 || true
}

# The sdist, unpacked. `--no-binary` names only this package: pip takes its build tools as wheels and
# only asks the backend for metadata (seconds); nothing is compiled here.
fetch_sdist() {
    [ -d "$SRC" ] && return 0
    "$PYTHON" -m pip download -q --no-deps --no-binary llama-cpp-python -d "$WORK" \
        "llama-cpp-python==$VERSION"
    tar xzf "$WORK/llama_cpp_python-$VERSION.tar.gz" -C "$WORK"
}

# The wheel, CPU only: no tests, examples, tools or server inside it (the defaults when llama.cpp is a
# subproject, spelled out). Not -march=native: a VM can report instructions its hypervisor does not
# run (AMX and AVX-512 on a firecracker VM: the native build died of SIGILL at its first compute), so
# x86-64 builds for AVX2/FMA/F16C, which every machine that reports them runs. The build folder is
# kept (build-dir), so an interrupted build resumes.
build_wheel() {
    echo "building llama-cpp-python $VERSION's wheel (llama.cpp's libraries; the long step)" >&2
    local cpu="-DGGML_NATIVE=OFF"
    [ "$(uname -m)" = x86_64 ] && cpu="$cpu -DGGML_AVX=ON -DGGML_AVX2=ON -DGGML_FMA=ON -DGGML_F16C=ON"
    CMAKE_ARGS="$cpu -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
-DLLAMA_BUILD_TOOLS=OFF -DLLAMA_BUILD_SERVER=OFF -DLLAMA_BUILD_APP=OFF" \
        CMAKE_BUILD_PARALLEL_LEVEL=$JOBS \
        "$PYTHON" -m pip wheel -v --no-deps -w "$WORK/dist" \
        -C build-dir="$WORK/wheel-build" -C build.verbose=false "$SRC" 2>&1 | progress "$WORK/wheel.log" \
        || { echo "the wheel's build failed: $WORK/wheel.log" >&2; exit 1; }
    mkdir -p "$DEST/wheels"
    mv "$WORK"/dist/llama_cpp_python-"$VERSION"-*.whl "$DEST/wheels/"
}

# llama-server: the server's objects (and llama-common-base's, a static part of common the server links
# into itself), linked against the wheel's shared libraries. The wheel's build options: shared libraries,
# common built, no curl, OpenSSL found. No web UI: its prebuilt assets would be downloaded.
build_server() {
    local wheel=$1 build="$WORK/server-build"
    echo "building llama-server (its own files only)" >&2
    cmake -S "$SRC/vendor/llama.cpp" -B "$build" -G Ninja \
        -DCMAKE_BUILD_TYPE=Release -DBUILD_SHARED_LIBS=ON -DLLAMA_BUILD_COMMON=ON -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_SERVER=ON -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF \
        -DLLAMA_USE_PREBUILT_UI=OFF -DLLAMA_BUILD_UI=OFF -DLLAMA_BUILD_NUMBER=1 >"$WORK/server-configure.log"
    mapfile -t objects < <(ninja -C "$build" -t targets all \
        | grep -oE '^(tools/(server|ui)/[^:]+|common/CMakeFiles/llama-common-base\.dir/[^:]+)\.o' | sort -u)
    ninja -C "$build" -j "$JOBS" "${objects[@]}" 2>&1 | progress "$WORK/server.log" \
        || { echo "llama-server's build failed: $WORK/server.log" >&2; exit 1; }
    # The wheel's libraries: its top-level lib/ (libllama-common, libmtmd, libllama, libggml*).
    rm -rf "$WORK/wheel-libs" && mkdir -p "$DEST/bin" "$DEST/lib"
    "$PYTHON" -m zipfile -e "$wheel" "$WORK/wheel-libs"
    cp -a "$WORK"/wheel-libs/lib/*.so* "$DEST/lib/"
    (cd "$build" && c++ -O3 "${objects[@]}" -o "$DEST/bin/llama-server.tmp" -L"$DEST/lib" \
        -Wl,-rpath,'$ORIGIN/../lib' -lllama-common -lmtmd -lllama -lggml -lggml-cpu -lggml-base \
        -lssl -lcrypto -lpthread)
    "$DEST/bin/llama-server.tmp" --version >/dev/null 2>&1
    mv "$DEST/bin/llama-server.tmp" "$DEST/bin/llama-server"
}

# A step and its time, with the load it ran under (a shared machine's builds vary with it).
step() {
    local began=$SECONDS
    "$@"
    echo "$1: $((SECONDS - began)) s, load average $(cut -d' ' -f1-3 /proc/loadavg)" >&2
}

wheel_path() {
    compgen -G "$DEST/wheels/llama_cpp_python-$VERSION-*.whl" | head -n 1 || true
}

mkdir -p "$WORK"
if [ -z "$(wheel_path)" ] || [ ! -x "$DEST/bin/llama-server" ]; then
    for tool in cmake ninja; do
        command -v "$tool" >/dev/null || "$PYTHON" -m pip install -q "$tool"
    done
    step fetch_sdist
    [ -n "$(wheel_path)" ] || step build_wheel
    [ -x "$DEST/bin/llama-server" ] || step build_server "$(wheel_path)"
fi
rm -rf "$WORK"
wheel_path
echo "$DEST/bin/llama-server"
