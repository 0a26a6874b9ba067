# Sourced by tests/gpu/run.sh. Where the system lacks the headers of kvd's
# build dependencies and .gpudeps/ holds their Debian packages (fetched
# elsewhere by tests/gpu/fetch-deps.sh), unpacks them into a private prefix
# and points CMake, the compiler's tools and the dynamic loader at it. Only
# the shared libraries the system does not already have go on the loader's
# path, so system programs keep their own. KVD_GPUDEPS_FORCE=1 uses the
# packages even where the system has the headers (to test this here).
kvd_deps_root="${kvd_deps_root:-$(pwd)}"
kvd_have_system_deps() {
    local h
    for h in zmq.h protobuf-c/protobuf-c.h lz4.h xxhash.h; do
        [ -e "/usr/include/$h" ] || [ -e "/usr/local/include/$h" ] || return 1
    done
    command -v protoc-c >/dev/null || return 1
}
if [ "${KVD_GPUDEPS_FORCE:-0}" = 1 ] || ! kvd_have_system_deps; then
    if ls "$kvd_deps_root"/.gpudeps/*.deb >/dev/null 2>&1; then
        prefix="${KVD_GPUDEPS_PREFIX:-/tmp/kvd-gpudeps}"
        rm -rf "$prefix"
        mkdir -p "$prefix/loader"
        for f in "$kvd_deps_root"/.gpudeps/*.deb; do
            dpkg-deb -x "$f" "$prefix" 2>/dev/null || (cd "$prefix" && ar p "$f" data.tar.xz | tar xJ)
        done
        # the loader path: sonames the system lacks, as links into the prefix
        for lib in "$prefix"/usr/lib/x86_64-linux-gnu/*.so.* "$prefix"/lib/x86_64-linux-gnu/*.so.*; do
            [ -e "$lib" ] || continue
            so="$(basename "$lib")"
            if [ "${KVD_GPUDEPS_FORCE:-0}" = 1 ] || ! ldconfig -p | grep -q " $so "; then
                ln -sf "$lib" "$prefix/loader/$so"
            fi
        done
        export CMAKE_PREFIX_PATH="$prefix/usr${CMAKE_PREFIX_PATH:+:$CMAKE_PREFIX_PATH}"
        export PATH="$prefix/usr/bin:$PATH"
        export LD_LIBRARY_PATH="$prefix/loader${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
        echo "deps: unpacked $(ls "$kvd_deps_root"/.gpudeps/*.deb | wc -l) packages from .gpudeps into $prefix;" \
             "$(ls "$prefix/loader" | wc -l) libraries on the loader's path"
    else
        echo "deps: the system lacks kvd's build dependencies and .gpudeps/ holds no packages" \
             "(run tests/gpu/fetch-deps.sh where Debian's archive is reachable, and carry .gpudeps)"
    fi
fi
