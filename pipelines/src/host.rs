//! Reading tensors back to the host. A device error that happened since the last read (an op
//! that failed on a PJRT device: out of memory, a plugin fault) surfaces here, and becomes
//! [`PipelineError::Device`] rather than a panic.

use burn::tensor::backend::{Backend, ExecutionError};
use burn::tensor::Tensor;

use crate::error::{PipelineError, Result};

/// The values of `t` as f32, or the device's error.
pub fn read_f32<B: Backend, const D: usize>(t: Tensor<B, D>) -> Result<Vec<f32>> {
    let data = t
        .try_into_data()
        .map_err(|e| PipelineError::Device(device_reason(&e)))?;
    data.convert::<f32>()
        .to_vec::<f32>()
        .map_err(|e| PipelineError::Device(format!("reading a tensor back: {e:?}")))
}

fn device_reason(e: &ExecutionError) -> String {
    match e {
        ExecutionError::WithContext { reason } | ExecutionError::Generic { reason, .. } => {
            reason.clone()
        }
    }
}
