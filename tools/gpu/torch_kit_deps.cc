// Links, and does nothing: //tools/gpu:torch_kit_deps exists so that its
// shared-library dependencies (Bazel's solibs of flatparam's libraries,
// which the linker keeps with -Wl,-no-as-needed) are what bundle.sh packs
// for the kit's CMake build of flatparam/torch (tools/gpu/torch_kit).
int main() { return 0; }
