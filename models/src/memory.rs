//! What a model's weights occupy, and where: bytes by the type they are held in (a float dtype,
//! or a GGML quant type for weights kept in their GGUF blocks) and by place (the host or a
//! device). `txt2img --json` reports it per component.

use std::collections::BTreeMap;

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Bool, DType, Int, Tensor};

/// Bytes of weights kept in GGML blocks, by quant type (`Q8_0`, `Q4_K`, ...): those of a model
/// read from a GGUF file, which stay in the file's map on the host.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct QuantizedBytes(pub BTreeMap<String, usize>);

/// Where the quantized blocks of a model are held.
pub const HOST: &str = "host";

/// A model's weights: bytes by the type they are held in and by place.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct WeightMemory {
    /// By dtype (`f32`, `bf16`, `f16`, ...) or GGML quant type (`Q8_0`, ...).
    pub by_type: BTreeMap<String, usize>,
    /// By place: [`HOST`] or a device's name.
    pub by_place: BTreeMap<String, usize>,
}

impl WeightMemory {
    /// The parameters of `module`, each at its device, named by `place`. A weight not yet
    /// materialized (a quantized weight's lazy dense form) is not counted: its blocks are
    /// ([`with_quantized`](Self::with_quantized)).
    pub fn of<B: Backend, M: Module<B>>(module: &M, place: impl Fn(&B::Device) -> String) -> Self {
        let mut visitor = Counter {
            memory: Self::default(),
            place,
        };
        module.visit(&mut visitor);
        visitor.memory
    }

    /// This with `quantized` blocks added, on the host.
    pub fn with_quantized(mut self, quantized: &QuantizedBytes) -> Self {
        for (kind, &bytes) in &quantized.0 {
            self.add(kind.clone(), HOST.to_string(), bytes);
        }
        self
    }

    /// Bytes in all.
    pub fn total(&self) -> usize {
        self.by_type.values().sum()
    }

    fn add(&mut self, kind: String, place: String, bytes: usize) {
        *self.by_type.entry(kind).or_default() += bytes;
        *self.by_place.entry(place).or_default() += bytes;
    }
}

/// The name a dtype is reported by (`f32`, `bf16`, ...), as the CLI's `--dtype` spells them.
pub fn dtype_name(dtype: DType) -> String {
    format!("{dtype:?}").to_lowercase()
}

struct Counter<P> {
    memory: WeightMemory,
    place: P,
}

impl<P> Counter<P> {
    fn count<B: Backend>(&mut self, dtype: DType, elements: usize, device: &B::Device)
    where
        P: Fn(&B::Device) -> String,
    {
        let place = (self.place)(device);
        self.memory
            .add(dtype_name(dtype), place, elements * dtype.size());
    }
}

impl<B: Backend, P: Fn(&B::Device) -> String> ModuleVisitor<B> for Counter<P> {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        if param.is_initialized() {
            let t = param.val();
            self.count::<B>(t.dtype(), t.shape().num_elements(), &t.device());
        }
    }

    fn visit_int<const D: usize>(&mut self, param: &Param<Tensor<B, D, Int>>) {
        if param.is_initialized() {
            let t = param.val();
            self.count::<B>(t.dtype(), t.shape().num_elements(), &t.device());
        }
    }

    fn visit_bool<const D: usize>(&mut self, param: &Param<Tensor<B, D, Bool>>) {
        if param.is_initialized() {
            let t = param.val();
            self.count::<B>(t.dtype(), t.shape().num_elements(), &t.device());
        }
    }
}
