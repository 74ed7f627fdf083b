//! dflash2: DFlash 2 speculative decoding for llama.cpp.
pub mod draft;
pub mod llama;
pub mod sampling;
pub mod template;
pub mod text;
pub mod verify;
pub mod target;
pub mod engine;
pub mod speculator;
pub mod dataset;
pub mod cli;
pub mod gguf;
pub mod server;
pub mod capi;
