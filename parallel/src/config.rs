//! How a model is spread over devices: tensor parallelism (each linear layer of a plan split
//! over `tp_degree` devices), data parallelism (the batch split over `dp_degree` devices), or
//! both, over a `dp x tp` device mesh; and the checks that say when a split cannot work.

/// Tensor parallelism: the linear layers a model's [`TensorParallelPlan`](crate::TensorParallelPlan)
/// names are split over `tp_degree` devices (as diffusers' `ContextParallelConfig` /
/// `TensorParallelConfig` are passed to `enable_parallelism`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TensorParallelConfig {
    /// Devices each sharded layer is split over (1: no tensor parallelism).
    pub tp_degree: usize,
}

impl TensorParallelConfig {
    pub fn new(tp_degree: usize) -> Self {
        Self { tp_degree }
    }
}

/// Data parallelism: each denoiser call's batch is split over `dp_degree` devices, each holding
/// every weight, in one compiled program.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct DataParallelConfig {
    /// Devices the batch is split over (1: no data parallelism).
    pub dp_degree: usize,
}

impl DataParallelConfig {
    pub fn new(dp_degree: usize) -> Self {
        Self { dp_degree }
    }
}

/// Both kinds over one device mesh of `dp_degree x tp_degree` devices: partition `p` sits at
/// row `p / tp_degree` (its slice of the batch) and column `p % tp_degree` (its slice of each
/// sharded layer).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ParallelConfig {
    pub tensor: TensorParallelConfig,
    pub data: DataParallelConfig,
}

impl Default for ParallelConfig {
    fn default() -> Self {
        Self {
            tensor: TensorParallelConfig::new(1),
            data: DataParallelConfig::new(1),
        }
    }
}

impl From<TensorParallelConfig> for ParallelConfig {
    fn from(tensor: TensorParallelConfig) -> Self {
        Self {
            tensor,
            ..Self::default()
        }
    }
}

impl From<DataParallelConfig> for ParallelConfig {
    fn from(data: DataParallelConfig) -> Self {
        Self {
            data,
            ..Self::default()
        }
    }
}

impl ParallelConfig {
    /// `dp_degree` x `tp_degree` devices.
    pub fn new(dp_degree: usize, tp_degree: usize) -> Self {
        Self {
            tensor: TensorParallelConfig::new(tp_degree),
            data: DataParallelConfig::new(dp_degree),
        }
    }

    pub fn tp(&self) -> usize {
        self.tensor.tp_degree
    }

    pub fn dp(&self) -> usize {
        self.data.dp_degree
    }

    /// Devices of the mesh (partitions of the compiled program).
    pub fn devices(&self) -> usize {
        self.tp() * self.dp()
    }

    /// Whether this spreads anything (more than one device).
    pub fn is_parallel(&self) -> bool {
        self.devices() > 1
    }

    /// Checks the config against the model's sharded widths, the devices there are and the
    /// mode the model runs in; every failure names the fix.
    pub fn validate(&self, target: &ParallelTarget<'_>) -> Result<(), ParallelError> {
        if self.tp() == 0 || self.dp() == 0 {
            return Err(ParallelError::ZeroDegree {
                tp: self.tp(),
                dp: self.dp(),
            });
        }
        if !self.is_parallel() {
            return Ok(());
        }
        if !target.compiled_pjrt {
            return Err(ParallelError::NeedsCompiledMode {
                device: target.device.to_string(),
            });
        }
        if self.tp() > 1 {
            for width in target.widths {
                if !width.size.is_multiple_of(self.tp()) {
                    return Err(ParallelError::Indivisible {
                        model: target.model.to_string(),
                        layer: width.layer.clone(),
                        what: width.what,
                        size: width.size,
                        tp: self.tp(),
                    });
                }
            }
        }
        if self.devices() > target.devices_available {
            return Err(ParallelError::TooFewDevices {
                tp: self.tp(),
                dp: self.dp(),
                needed: self.devices(),
                available: target.devices_available,
                device: target.device.to_string(),
            });
        }
        Ok(())
    }
}

/// A size that the tensor-parallel degree must divide: the heads of a sharded attention, the
/// inner width of a sharded feed-forward.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ShardedWidth {
    /// The layer's checkpoint path (`down_blocks.0.attentions.0.transformer_blocks.0.attn1`).
    pub layer: String,
    /// `"attention heads"` or `"feed-forward width"`.
    pub what: &'static str,
    pub size: usize,
}

impl ShardedWidth {
    pub fn heads(layer: impl Into<String>, heads: usize) -> Self {
        Self {
            layer: layer.into(),
            what: "attention heads",
            size: heads,
        }
    }

    pub fn feed_forward(layer: impl Into<String>, width: usize) -> Self {
        Self {
            layer: layer.into(),
            what: "feed-forward width",
            size: width,
        }
    }
}

/// What a config is checked against ([`ParallelConfig::validate`]).
#[derive(Debug, Clone)]
pub struct ParallelTarget<'a> {
    /// The model's class name, for messages.
    pub model: &'a str,
    /// Its sharded widths ([`ShardedWidth`]).
    pub widths: &'a [ShardedWidth],
    /// The device the model is on (`xla:cpu:0`, `cpu`), for messages.
    pub device: &'a str,
    /// Devices of that device's platform.
    pub devices_available: usize,
    /// Whether the model runs compiled on a PJRT device (the partitioner works on whole
    /// compiled programs; eager ops and the CPU backend cannot be split).
    pub compiled_pjrt: bool,
}

/// Why a parallel config cannot be applied.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum ParallelError {
    #[error("tp_degree {tp} and dp_degree {dp}: both must be at least 1 (1 turns that kind of parallelism off)")]
    ZeroDegree { tp: usize, dp: usize },
    #[error("tp_degree {tp} does not divide the {size} {what} of {model} layer `{layer}`: pick a tp_degree that divides every sharded layer's heads and feed-forward width")]
    Indivisible {
        model: String,
        layer: String,
        what: &'static str,
        size: usize,
        tp: usize,
    },
    #[error("tp_degree {tp} x dp_degree {dp} needs {needed} devices but {device}'s platform has {available}: lower the degrees (XLA's CPU plugin shows OXIDIFF_XLA_CPU_DEVICES devices, default 2)")]
    TooFewDevices {
        tp: usize,
        dp: usize,
        needed: usize,
        available: usize,
        device: String,
    },
    #[error("parallelism needs compiled mode on a PJRT device, but the model is on {device}: move it to a PJRT device (xla:cpu, tpu, cuda) and compile it (`pipe.to(..)`, `--device tpu --compile`)")]
    NeedsCompiledMode { device: String },
}

#[cfg(test)]
mod tests {
    use super::*;

    fn target(widths: &[ShardedWidth], available: usize, compiled: bool) -> ParallelTarget<'_> {
        ParallelTarget {
            model: "Test",
            widths,
            device: "xla:cpu:0",
            devices_available: available,
            compiled_pjrt: compiled,
        }
    }

    #[test]
    fn degrees_must_divide_widths_fit_the_devices_and_run_compiled() {
        let widths = [
            ShardedWidth::heads("blocks.0.attn1", 8),
            ShardedWidth::feed_forward("blocks.0.ff", 12),
        ];
        let ok = target(&widths, 4, true);
        assert_eq!(ParallelConfig::new(1, 4).validate(&ok), Ok(()));
        assert_eq!(ParallelConfig::new(2, 2).validate(&ok), Ok(()));
        let err = ParallelConfig::new(1, 8).validate(&ok).unwrap_err();
        assert!(
            matches!(
                &err,
                ParallelError::Indivisible {
                    size: 12,
                    tp: 8,
                    ..
                }
            ),
            "{err}"
        );
        assert!(err.to_string().contains("blocks.0.ff"), "{err}");
        let err = ParallelConfig::new(1, 3).validate(&ok).unwrap_err();
        assert!(matches!(err, ParallelError::Indivisible { size: 8, .. }));
        // Data parallelism does not split layers.
        assert_eq!(
            ParallelConfig::new(3, 1).validate(&target(&widths, 3, true)),
            Ok(())
        );
        let err = ParallelConfig::new(4, 2).validate(&ok).unwrap_err();
        assert!(matches!(
            err,
            ParallelError::TooFewDevices {
                needed: 8,
                available: 4,
                ..
            }
        ));
        let err = ParallelConfig::new(1, 2)
            .validate(&target(&widths, 4, false))
            .unwrap_err();
        assert!(err.to_string().contains("compiled mode"), "{err}");
        assert!(ParallelConfig::new(0, 2).validate(&ok).is_err());
        // One device is no parallelism: nothing to check.
        assert_eq!(
            ParallelConfig::default().validate(&target(&widths, 1, false)),
            Ok(())
        );
    }
}
