//! Flotilla's model engine: a decoder-only transformer whose forward,
//! backward and memory layout Flotilla owns (in the spirit of llm.c).
//!
//! Legend used in every shape comment:
//! B = batch size, T = sequence length, C = channels (d_model),
//! N = B*T rows, V = vocab size, H = query heads, K = key/value heads,
//! D = head dim, F = feed-forward width.
//!
//! - [`real`]: the float trait the kernels are generic over (f32 fast
//!   path, f64 reference path for finite-difference checks).
//! - [`threads`]: the explicit-size thread pool every kernel runs on.
//! - [`kernels`]: layers as free functions over slices, outputs first,
//!   each with its backward.
// Kernels take explicit buffers and dimensions (llm.c's convention: outputs,
// inputs, then sizes), so long argument lists are the design, not a smell.
#![allow(clippy::too_many_arguments)]

pub mod error;
pub mod gradcheck;
pub mod kernels;
pub mod memory;
pub mod optim;
pub mod real;
pub mod rng;
pub mod threads;

pub use error::{ModelError, Result};
pub use real::Real;
pub use threads::Threads;
pub mod block;
pub mod config;
pub mod init;
pub mod interop;
pub mod layout;
pub mod model;
pub mod moe;
pub mod profile;
pub mod sample;
pub mod stage;
