//! # flotilla-plan: do the arithmetic first
//!
//! File 001 §12.8 opens the production checklist with "do the arithmetic first". This crate is
//! that arithmetic, taken from the seeds (000: distributed training and collectives; 004: compute
//! infrastructure) and from the papers they rest on (Korthikanti et al. 2022, Narayanan et al.
//! 2021, Young 1974, Daly 2006):
//!
//! - typed, validated inputs: [`job::JobFile`] / [`cluster::ClusterFile`] (TOML) with model,
//!   device and link presets ([`model`], [`hardware`]);
//! - one module per model: [`collectives`], [`memory`], [`pipeline`], [`step`], [`scaling`],
//!   [`reliability`], [`data`], [`storage`], [`cost`], [`roofline`];
//! - [`search`] over layouts, [`sweep`] over cluster sizes (cost, deadline), [`lint`] for the
//!   seeds' fallacies, [`report`] to tie them together.
//!
//! ```
//! use plan::{cluster::{Cluster, ClusterFile}, job::{Job, JobFile}, report::plan};
//! let job = Job::from_file(&JobFile::preset("llama2-7b", 256)).unwrap();
//! let cluster = Cluster::from_file(&ClusterFile::preset("h100", 4)).unwrap();
//! let r = plan(&job, &cluster, None).unwrap();
//! assert!(r.evaluation.unwrap().mfu > 0.2);
//! ```
//!
//! Units are SI (bytes, seconds); bandwidths are unidirectional per device ([`units`]).

pub mod cluster;
pub mod collectives;
pub mod cost;
pub mod data;
pub mod engine_memory;
pub mod error;
pub mod gemm;
pub mod hardware;
pub mod job;
pub mod kernels;
pub mod layout;
pub mod lint;
pub mod memory;
pub mod model;
pub mod nccl;
pub mod pipeline;
pub mod reliability;
pub mod report;
pub mod roofline;
pub mod scaling;
pub mod search;
pub mod step;
pub mod storage;
pub mod sweep;
pub mod units;
pub mod validate;

pub use error::{PlanError, Result};
