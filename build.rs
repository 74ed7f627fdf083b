//! Builds the C++ shim in `vendor/` that re-exports llama.cpp's staging DFlash API
//! (`llama-ext.h`, C++ linkage, not wrapped by llama-cpp-sys-2) as `extern "C"`,
//! and generates its Rust bindings with bindgen.
//!
//! Headers come only from the sys crate's build metadata: `DEP_LLAMA_ROOT/include`
//! holds the installed `llama.h`/`ggml*.h`; the llama.cpp source tree (for
//! `src/llama-ext.h` and `common/`) is the `CMAKE_HOME_DIRECTORY` recorded in the
//! CMake cache of that same build.
use std::env;
use std::fs;
use std::path::PathBuf;

/// dflash2's own CPU kernels, plugged into ggml's CPU backend, and their shared headers.
const KERNELS: &[&str] = &[
    "vendor/amx_few_rows.cpp",
    "vendor/cpu_extra.cpp",
    "vendor/drafter_conv.cpp",
    "vendor/drafter_ops.cpp",
    "vendor/drafter_rows.cpp",
    "vendor/f16_attention.cpp",
    "vendor/kquant_rows.cpp",
    "vendor/kx8_rows.cpp",
    "vendor/q4_x8_rows.cpp",
    "vendor/q8_0_attention.cpp",
    "vendor/quant_rows.cpp",
];
const KERNEL_HEADERS: &[&str] = &["vendor/cpu_extra.h", "vendor/repacked.h"];

fn main() {
    let root = PathBuf::from(
        env::var("DEP_LLAMA_ROOT").expect("DEP_LLAMA_ROOT not set: llama-cpp-sys-2 must be a direct dependency"),
    );
    let include = root.join("include");
    let cache_path = root.join("build").join("CMakeCache.txt");
    let cache = fs::read_to_string(&cache_path)
        .unwrap_or_else(|e| panic!("cannot read {}: {e}", cache_path.display()));
    let src_dir = cache
        .lines()
        .find_map(|l| l.strip_prefix("CMAKE_HOME_DIRECTORY:INTERNAL="))
        .map(PathBuf::from)
        .expect("CMAKE_HOME_DIRECTORY missing from llama.cpp's CMakeCache.txt");

    let includes = [include.clone(), src_dir.join("src"), src_dir.join("common"), src_dir.join("ggml/include")];

    let mut build = cc::Build::new();
    build.cpp(true).std("c++17").files(["vendor/dflash2_shim.cpp", "vendor/dflash2_chat.cpp"]).warnings(false);
    for dir in &includes {
        build.include(dir);
    }
    build.compile("dflash2_shim");

    // The kernels (few-row AMX products, f16 and q8_0 attention, Q5_0 products, the drafter's ops) read ggml's
    // CPU internals and are built for the CPU ggml was built for: with `-march=native` where
    // llama.cpp is (GGML_NATIVE), else as stubs.
    let native = cache.lines().any(|l| l == "GGML_NATIVE:BOOL=ON");
    let mut kernels = cc::Build::new();
    kernels.cpp(true).std("c++17").files(KERNELS).warnings(false);
    for dir in includes.iter().chain([&src_dir.join("ggml/src")]) {
        kernels.include(dir);
    }
    kernels.include("vendor");
    if native {
        kernels.flag("-march=native");
    }
    kernels.compile("dflash2_kernels");
    // A probe cached by an earlier build of these kernels must not stand for this one.
    let source: Vec<u8> = KERNELS
        .iter()
        .chain(KERNEL_HEADERS)
        .flat_map(|f| fs::read(f).unwrap_or_else(|e| panic!("cannot read {f}: {e}")))
        .collect();
    let hash = source.iter().fold(0xcbf29ce484222325u64, |h, &b| (h ^ u64::from(b)).wrapping_mul(0x100000001b3));
    println!("cargo:rustc-env=DFLASH2_KERNELS_HASH={hash:016x}{}", if native { " native" } else { "" });

    let bindings = bindgen::Builder::default()
        .header("vendor/dflash2_shim.h")
        .clang_arg(format!("-I{}", include.display()))
        .allowlist_function("dflash2_.*")
        .allowlist_type("dflash2_.*")
        // llama.cpp's own types come from llama-cpp-sys-2, so the two crates agree on them.
        .blocklist_type("llama_.*")
        .blocklist_type("ggml_.*")
        .raw_line("use llama_cpp_sys_2::*;")
        .generate()
        .expect("bindgen failed on vendor/dflash2_shim.h");
    let out = PathBuf::from(env::var("OUT_DIR").unwrap()).join("shim_bindings.rs");
    bindings.write_to_file(&out).expect("cannot write shim bindings");

    // The llama.h a C frontend must compile against to pass its pointers to dflash2_spec_*
    // (the tests build ffi/examples/frontend.c with it).
    println!("cargo:rustc-env=DFLASH2_LLAMA_INCLUDE={}", include.display());
    println!("cargo:rerun-if-changed=vendor/dflash2_shim.cpp");
    println!("cargo:rerun-if-changed=vendor/dflash2_shim.h");
    println!("cargo:rerun-if-changed=vendor/dflash2_chat.cpp");
    for file in KERNELS.iter().chain(KERNEL_HEADERS) {
        println!("cargo:rerun-if-changed={file}");
    }
    println!("cargo:rerun-if-changed=build.rs");
}
