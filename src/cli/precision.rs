//! `--dtype`: the weight precision the binaries take (diffusers' `torch_dtype`).

use burn::tensor::FloatDType;

/// `--dtype`: f32, bf16 or f16.
#[derive(Debug, Clone, Copy, PartialEq, Eq, clap::ValueEnum)]
pub enum Precision {
    F32,
    Bf16,
    F16,
}

impl Precision {
    /// The flag's spelling, as the summaries print it.
    pub fn name(self) -> &'static str {
        match self {
            Self::F32 => "f32",
            Self::Bf16 => "bf16",
            Self::F16 => "f16",
        }
    }

    /// Burn's dtype of the weights.
    pub fn float_dtype(self) -> FloatDType {
        match self {
            Self::F32 => FloatDType::F32,
            Self::Bf16 => FloatDType::BF16,
            Self::F16 => FloatDType::F16,
        }
    }

    /// What `LoadOptions::dtype` takes: `None` for f32 (the checkpoint as stored, in f32).
    pub fn load_dtype(self) -> Option<FloatDType> {
        (self != Self::F32).then(|| self.float_dtype())
    }
}
