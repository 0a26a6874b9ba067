# Cross build for aarch64 with Debian's cross compiler (gcc-aarch64-linux-gnu)
# and the arm64 libraries of a multiarch system (dpkg --add-architecture arm64;
# the -dev packages of scripts/install-deps.sh as :arm64). ctest runs the
# binaries under qemu-user (qemu-user-static). scripts/test-arm64.sh does it all.
set(CMAKE_SYSTEM_NAME Linux)
set(CMAKE_SYSTEM_PROCESSOR aarch64)
set(CMAKE_C_COMPILER aarch64-linux-gnu-gcc)
set(CMAKE_LIBRARY_ARCHITECTURE aarch64-linux-gnu)
set(CMAKE_FIND_ROOT_PATH_MODE_PROGRAM NEVER)
set(CMAKE_CROSSCOMPILING_EMULATOR qemu-aarch64-static)
