//! kvgate-backend as a library: the model, the KV block pool, the engine and the HTTP surface.
//! The binary (`main.rs`) wires them from command-line flags; tests and benchmarks use them
//! directly.

pub mod api;
pub mod cpu;
pub mod engine;
pub mod forward;
pub mod handle;
pub mod metrics;
pub mod model;
pub mod pollers;
pub mod pool;
pub mod published;
pub mod random_weights;
pub mod sampling;
pub mod synthetic;
pub mod tokenizer;
pub mod weights;
