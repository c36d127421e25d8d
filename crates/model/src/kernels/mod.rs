//! Layers as free functions over slices: outputs first, then inputs, then
//! dimensions (llm.c's convention). Every `*_bwd` mirrors its `*_fwd` and
//! accumulates (`+=`) into parameter gradients. All are generic over
//! [`Real`](crate::Real): f32 is the fast path, f64 the reference path the
//! gradient checks use.
pub mod activation;
pub mod attention;
pub mod embedding;
pub mod loss;
pub mod matmul;
pub mod norm;
pub mod residual;
pub mod rope;
pub mod sgemm;
pub(crate) mod vmath;
