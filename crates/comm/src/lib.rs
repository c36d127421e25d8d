//! # flotilla-comm: the gradient bus
//!
//! Collective communication for Flotilla's training engines: a rendezvous [`store`], byte
//! [`transport`]s (TCP between any two ranks, shared memory within a host), process [`group`]s with
//! group-wide sequence numbers, and collective algorithms ([`algo`]), one module each with its
//! alpha-beta cost at the top, chosen per call by the [`model`] from calibrated link parameters.
//! A device [`mesh`] arranges a group's ranks as (dp, pp, tp, ep) with one process group per axis,
//! keeping tensor-parallel groups inside a host.
//!
//! No op waits forever: each carries a deadline, and a dead, silent or mismatched peer turns into
//! a [`CommError`] that names the op, the group and the rank(s) it was waiting for, with the
//! group's [`flight`] recorder printed beside it.

pub mod algo;
pub mod bench;
pub mod buffer;
pub mod dtype;
pub mod engine;
pub mod error;
pub mod flight;
pub mod frame;
pub mod group;
pub mod local;
pub mod mesh;
pub mod model;
pub mod partition;
pub mod store;
pub mod trace;
pub mod transport;

pub use dtype::{DType, Element, ReduceOp};
pub use error::{CommError, OpDesc, Result};
pub use frame::OpKind;
