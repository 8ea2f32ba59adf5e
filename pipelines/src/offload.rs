//! Offload: components a pipeline hands back between uses ([`Offload`]), the release of a
//! model's device copies ([`release_weights`]), and, on XLA's CPU plugin, the host memory handed
//! back before a decode ([`before_decoding`]).
//!
//! Only weights read from a memory-mapped checkpoint can be handed back: each is uploaded again
//! from the file (the page cache, after the first time) the next time an op or compiled
//! program needs it, so nothing is held on the host meanwhile. Weights on the CPU, and weights
//! made or changed in memory (LoRA fused in, quantized blocks, a dtype converted at load), stay
//! where they are.

use std::any::Any;
use std::fmt;
use std::str::FromStr;

use burn::module::{Module, ModuleVisitor, Param};
use burn::tensor::backend::Backend;
use burn::tensor::Tensor;
use oxidiff_backend_tpu::spmd::{tensor_id, TensorId};
use oxidiff_backend_tpu::{pjrt_client, Oxi, OxiDevice};
use oxidiff_models::AutoencoderKL;

use crate::error::{PipelineError, Result};

/// What a pipeline hands back between requests (diffusers' `enable_model_cpu_offload`, for the
/// components a request uses once).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub enum Offload {
    /// Every component keeps its device copy.
    #[default]
    Off,
    /// The text encoders' device copies are freed once a request's prompts are encoded, and
    /// uploaded again from the checkpoint for the next request (their embedding tables stay on
    /// the host in any case): the denoiser and the VAE run with that much less device memory
    /// in use, for one upload of the text encoders per request. On XLA's CPU plugin, whose
    /// device memory is the process's heap, the memory the last component's programs freed is
    /// also handed back to the kernel before the text encoders are uploaded again, so that
    /// they do not come on top of it (before the VAE decodes it is, offload or not:
    /// [`before_decoding`]).
    TextEncoders,
}

impl Offload {
    /// Whether the text encoders are handed back after encoding.
    pub fn text_encoders(self) -> bool {
        self == Self::TextEncoders
    }

    /// Hands back text encoder `encoder` if this offload says so; returns the bytes freed.
    pub(crate) fn after_encoding<B: Backend, M: Module<B>>(self, encoder: &M) -> usize {
        if !self.text_encoders() {
            return 0;
        }
        release_weights(encoder)
    }
}

/// Before the VAE (`vae`) decodes, on XLA's CPU plugin (nothing elsewhere), whatever the
/// offload: frees the host kernels' spare transform buffer, sized by the denoiser's largest
/// layer ([`release_call_buffer`](oxidiff_models::cpu::conv::release_call_buffer)), and hands
/// the free memory of the process's heap, what the denoising loop's programs freed, back to
/// the kernel once the work in flight is done. The binaries' allocator keeps freed memory
/// (`tune_allocator`), so without this the decode's working memory (its activations at full
/// resolution) came on top of the denoiser's. The pipelines' decode
/// ([`decode_to_tensor`](crate::denoise::decode_to_tensor)) calls it; so does code that calls
/// the VAE itself.
pub fn before_decoding<B: Backend>(vae: &AutoencoderKL<B>) {
    let device = vae.decoder.conv_in.weight.device();
    let Some(client) = (&device as &dyn Any)
        .downcast_ref::<OxiDevice>()
        .and_then(pjrt_client)
    else {
        return;
    };
    if client.device_memory_is_host_heap() {
        oxidiff_models::cpu::conv::release_call_buffer();
        client.return_free_host_memory();
    }
}

impl fmt::Display for Offload {
    /// The name [`FromStr`] reads.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Self::Off => "off",
            Self::TextEncoders => "text-encoders",
        })
    }
}

impl FromStr for Offload {
    type Err = PipelineError;

    /// `off` or `text-encoders`.
    fn from_str(name: &str) -> Result<Self> {
        match name {
            "off" => Ok(Self::Off),
            "text-encoders" => Ok(Self::TextEncoders),
            other => Err(PipelineError::InvalidInput(format!(
                "unknown offload `{other}`: use `off` or `text-encoders`"
            ))),
        }
    }
}

/// Frees the device copies of `module`'s weights that were read from a memory-mapped file;
/// each is uploaded again from the file the next time an op or program needs it. Only
/// [`Oxi`] tensors on PJRT devices are released (nothing for any other backend). Returns the
/// bytes freed.
pub fn release_weights<B: Backend, M: Module<B>>(module: &M) -> usize {
    WeightIds::of(module)
        .by_device
        .into_iter()
        .filter_map(|(device, ids)| Some(pjrt_client(&device)?.release(ids)))
        .sum()
}

/// The tensor ids of a module's loaded float weights on PJRT devices, by device.
#[derive(Default)]
struct WeightIds {
    by_device: Vec<(OxiDevice, Vec<TensorId>)>,
}

impl WeightIds {
    /// `module`'s.
    fn of<B: Backend, M: Module<B>>(module: &M) -> Self {
        let mut ids = Self::default();
        module.visit(&mut ids);
        ids
    }
}

impl<B: Backend> ModuleVisitor<B> for WeightIds {
    fn visit_float<const D: usize>(&mut self, param: &Param<Tensor<B, D>>) {
        // A lazy weight not made yet holds no device memory.
        if !param.is_initialized() {
            return;
        }
        let tensor = param.val();
        let Some(tensor) = (&tensor as &dyn Any).downcast_ref::<Tensor<Oxi, D>>() else {
            return;
        };
        let device = tensor.device();
        if !device.is_pjrt() {
            return;
        }
        let id = tensor_id(&tensor.clone().into_primitive().tensor());
        match self.by_device.iter_mut().find(|(d, _)| *d == device) {
            Some((_, ids)) => ids.push(id),
            None => self.by_device.push((device, vec![id])),
        }
    }
}
