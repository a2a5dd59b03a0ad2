//! The kernel families' GPU test cases, registered in [`crate::gpu_test::all_cases`] in this
//! order: [`intranode`], [`low_latency`], [`internode`].

pub mod internode;
pub mod intranode;
pub mod low_latency;
