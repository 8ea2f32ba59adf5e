//! Reading XLA's optimized program ([`Executable::optimized_program`](super::Executable::optimized_program)):
//! just enough of `xla/service/hlo.proto` to list each instruction's opcode, e.g. to count
//! the collectives the SPMD partitioner inserted.

use std::collections::BTreeMap;

use prost::Message;

use super::{Error, Result};

/// `xla.HloModuleProtoWithConfig` (subset).
#[derive(Clone, PartialEq, prost::Message)]
struct HloModuleProtoWithConfig {
    #[prost(message, optional, tag = "1")]
    hlo_module: Option<HloModuleProto>,
}

/// `xla.HloModuleProto` (subset).
#[derive(Clone, PartialEq, prost::Message)]
struct HloModuleProto {
    #[prost(message, repeated, tag = "3")]
    computations: Vec<HloComputationProto>,
}

/// `xla.HloComputationProto` (subset).
#[derive(Clone, PartialEq, prost::Message)]
struct HloComputationProto {
    #[prost(message, repeated, tag = "2")]
    instructions: Vec<HloInstructionProto>,
}

/// `xla.HloInstructionProto` (subset).
#[derive(Clone, PartialEq, prost::Message)]
struct HloInstructionProto {
    #[prost(string, tag = "2")]
    opcode: String,
}

/// How many instructions of each opcode (`all-reduce`, `dot`, `fusion`, ...) a program in
/// `format` (`hlo_with_config` or `hlo`) has, over all its computations (fused ones too).
pub fn opcode_counts(format: &str, bytes: &[u8]) -> Result<BTreeMap<String, usize>> {
    let bad = |e: prost::DecodeError| {
        Error::InvalidArgument(format!(
            "the optimized program is not a {format} proto: {e}"
        ))
    };
    let module = match format {
        "hlo_with_config" => HloModuleProtoWithConfig::decode(bytes)
            .map_err(bad)?
            .hlo_module
            .unwrap_or_default(),
        "hlo" => HloModuleProto::decode(bytes).map_err(bad)?,
        other => {
            return Err(Error::InvalidArgument(format!(
                "optimized program in format `{other}`: only hlo and hlo_with_config are read"
            )))
        }
    };
    let mut counts = BTreeMap::new();
    for computation in &module.computations {
        for instruction in &computation.instructions {
            *counts.entry(instruction.opcode.clone()).or_insert(0) += 1;
        }
    }
    Ok(counts)
}
