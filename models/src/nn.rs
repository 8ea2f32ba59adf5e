//! The handful of layers every model here is made of, loaded from PyTorch-layout weights.
//!
//! Written once and shared by the UNet, VAE and text encoders. Each layer's weights are named as
//! in PyTorch (`weight`, `bias`), so a layer is loaded from `vb.pp("conv1")` with no remapping.

use std::collections::BTreeSet;
use std::sync::Mutex;

use burn::module::{Module, Param, ParamId};
use burn::tensor::activation;
use burn::tensor::backend::Backend;
use burn::tensor::module::{conv2d, embedding, linear};
use burn::tensor::ops::ConvOptions;
use burn::tensor::{DType, FloatDType, Int, Tensor, TensorData};

use crate::cpu::common::is_flex;
use crate::cpu::conv::{self as cpu_conv, ConvGeometry};
use crate::cpu::elementwise as cpu_elementwise;
use crate::cpu::linear as cpu_linear;
use crate::cpu::quantized_linear as cpu_quantized;
use crate::error::{ModelError, Result};
use crate::gguf::QuantizedMatrix;
use crate::var_builder::{lazy_param, VarBuilder};
use crate::weight_data;

/// `torch.nn.Linear`; the weight is Burn's `[in, out]`, a transposed view of the checkpoint's
/// `[out, in]` tensor (so loading copies nothing; the matrix products read it through its
/// strides).
///
/// A weight stored quantized (a GGUF file) is kept in its blocks in `quantized` and multiplied
/// block by block on the CPU backend. On other backends (PJRT devices) it is held as integers
/// with their scales (`blocks`, made at load) and dequantized inside each call,
/// which compiled mode traces into the program, where XLA fuses it into the product. `weight`
/// is then a lazy parameter that dequantizes it only when something asks for the dense tensor
/// (a cast through Burn's own mappers, tensor parallelism); once it has, the dense weight is
/// the one used.
#[derive(Module, Debug)]
pub struct Linear<B: Backend> {
    pub weight: Param<Tensor<B, 2>>,
    pub bias: Option<Param<Tensor<B, 1>>>,
    #[module(skip)]
    pub quantized: Option<QuantizedMatrix>,
    pub blocks: Option<DeviceBlocks<B>>,
}

/// A quantized `[out, in]` weight as a device holds it ([`IntegerBlocks`]): `values` one
/// integer each, `scales` (and `offsets`, for the types with minima) one per group of values
/// along a row, shaped `[out, in / group, 1]`. Built at load on every backend but burn-flex
/// (whose kernels read the blocks themselves).
#[derive(Module, Debug)]
pub struct DeviceBlocks<B: Backend> {
    pub values: Param<Tensor<B, 2, Int>>,
    pub scales: Param<Tensor<B, 3>>,
    pub offsets: Option<Param<Tensor<B, 3>>>,
}

impl<B: Backend> DeviceBlocks<B> {
    /// `matrix` as integers and scales on `device` (`None` for a plain float matrix).
    fn new(matrix: &QuantizedMatrix, device: &B::Device) -> Option<Self> {
        matrix.kind().group()?;
        let (rows, cols) = (matrix.rows(), matrix.cols());
        let blocks = matrix.integer_blocks();
        let groups = cols / blocks.group;
        let per_group = |values: Vec<f32>| {
            let data = TensorData::new(values, [rows, groups, 1]);
            Param::from_tensor(Tensor::<B, 3>::from_data(data, (device, DType::F32)))
        };
        let data = TensorData::new(blocks.values, [rows, cols]);
        Some(Self {
            values: Param::initialized(
                ParamId::new(),
                Tensor::<B, 2, Int>::from_data(data, (device, DType::I8)),
            ),
            scales: per_group(blocks.scales),
            offsets: blocks.offsets.map(per_group),
        })
    }

    /// The `[out, in]` weight, `scale * value - offset` per group, in the scales' dtype: f32
    /// (equal to the blocks' own dequantization) unless the model was cast
    /// ([`ToDType`](crate::ToDType) casts the scales with every float parameter).
    fn dequantize(&self) -> Tensor<B, 2> {
        let [rows, cols] = self.values.lazy_shape().dims();
        let groups = self.scales.lazy_shape().dims::<3>()[1];
        let scales = self.scales.val();
        let values = self.values.val().float();
        let values = match scales.dtype() {
            DType::F32 => values,
            dtype => values.cast(dtype),
        };
        let mut w = values.reshape([rows, groups, cols / groups]) * scales;
        if let Some(offsets) = &self.offsets {
            w = w - offsets.val();
        }
        w.reshape([rows, cols])
    }
}

impl<B: Backend> Linear<B> {
    pub fn load(vb: &VarBuilder<B>, d_in: usize, d_out: usize, bias: bool) -> Result<Self> {
        let quantized = vb.get_quantized_linear("weight", d_in, d_out)?;
        let weight = match &quantized {
            Some(matrix) => lazy_dense(matrix.clone(), vb.dtype(), vb.device()),
            None => vb.linear_weight_param("weight", d_in, d_out)?,
        };
        let blocks = quantized
            .as_ref()
            .filter(|_| !is_flex::<B>())
            .and_then(|matrix| DeviceBlocks::new(matrix, vb.device()));
        let bias = if bias {
            Some(vb.param("bias", [d_out])?)
        } else {
            None
        };
        Ok(Self {
            weight,
            bias,
            quantized,
            blocks,
        })
    }

    /// Input and output features, without dequantizing a quantized weight.
    pub fn dims(&self) -> [usize; 2] {
        let shape = self.weight.lazy_shape();
        [shape[0], shape[1]]
    }

    /// On burn-flex with a quantized weight through [`crate::cpu::quantized_linear`]; in bf16
    /// with AMX through [`crate::cpu::linear`]; elsewhere Burn's `linear` on `x` flattened to
    /// rows: for a 2-D input Burn multiplies by the weight as it is, while for more dimensions
    /// it would first reshape the weight, which copies a strided view on every call.
    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let mut bias = self.bias.as_ref().map(|b| b.val());
        let mut x = x;
        if let Some(matrix) = self
            .quantized
            .as_ref()
            .filter(|_| !self.weight.is_initialized())
        {
            match cpu_quantized::linear(x, matrix, bias) {
                Ok(out) => return out,
                Err((back, b)) => (x, bias) = (back, b),
            }
            if let Some(blocks) = &self.blocks {
                let weight = blocks.dequantize();
                let weight = match x.dtype() {
                    dtype if dtype == weight.dtype() => weight,
                    dtype => weight.cast(dtype),
                };
                return linear_rows(x, weight.transpose(), bias);
            }
        }
        match cpu_linear::linear(x, self.weight.val(), bias) {
            Ok(out) => out,
            Err((x, weight, bias)) => linear_rows(x, weight, bias),
        }
    }
}

/// Burn's `linear` on `x` flattened to rows (`weight` `[in, out]`).
fn linear_rows<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    weight: Tensor<B, 2>,
    bias: Option<Tensor<B, 1>>,
) -> Tensor<B, D> {
    if D <= 2 {
        return linear(x, weight, bias);
    }
    let mut dims = x.dims();
    let d_in = dims[D - 1];
    let rows = x.shape().num_elements() / d_in.max(1);
    let out = linear(x.reshape([rows, d_in]), weight, bias);
    dims[D - 1] = out.dims()[1];
    out.reshape(dims)
}

/// The ids of the quantized weights' lazy dense forms ([`lazy_dense`]). Weights converted at
/// their first use are lazy parameters too; this is what tells the two apart
/// ([`is_quantized_dense`]).
static QUANTIZED_DENSE: Mutex<BTreeSet<ParamId>> = Mutex::new(BTreeSet::new());

/// Whether the parameter `id` is a quantized weight's dense form, made from its GGUF blocks
/// only when asked for (a LoRA cannot be fused into the blocks); not a weight that waits for
/// its first use to be converted from its stored float type.
pub fn is_quantized_dense(id: ParamId) -> bool {
    QUANTIZED_DENSE.lock().map_or_else(
        |poisoned| poisoned.into_inner().contains(&id),
        |ids| ids.contains(&id),
    )
}

/// The `[in, out]` dense weight of `matrix` in `dtype`, computed when first asked for.
fn lazy_dense<B: Backend>(
    matrix: QuantizedMatrix,
    dtype: FloatDType,
    device: &B::Device,
) -> Param<Tensor<B, 2>> {
    let param = lazy_param(
        [matrix.cols(), matrix.rows()],
        device.clone(),
        move |device| {
            let data = weight_data::from_f32(
                matrix.dequantize(),
                vec![matrix.rows(), matrix.cols()],
                dtype,
            );
            let dtype = data.dtype;
            Tensor::<B, 2>::from_data(data, (device, dtype)).transpose()
        },
    );
    match QUANTIZED_DENSE.lock() {
        Ok(mut ids) => ids.insert(param.id),
        Err(poisoned) => poisoned.into_inner().insert(param.id),
    };
    param
}

/// `torch.nn.Conv2d` with square kernel, symmetric padding and optional groups.
#[derive(Module, Debug)]
pub struct Conv2d<B: Backend> {
    pub weight: Param<Tensor<B, 4>>,
    pub bias: Option<Param<Tensor<B, 1>>>,
    pub stride: usize,
    pub padding: usize,
    pub groups: usize,
}

/// Shape of a convolution: channels, kernel, stride and padding.
#[derive(Debug, Clone, Copy)]
pub struct ConvSpec {
    pub c_in: usize,
    pub c_out: usize,
    pub kernel: usize,
    pub stride: usize,
    pub padding: usize,
}

impl ConvSpec {
    /// A `k x k` convolution with stride 1 and "same" padding.
    pub fn same(c_in: usize, c_out: usize, kernel: usize) -> Self {
        Self {
            c_in,
            c_out,
            kernel,
            stride: 1,
            padding: kernel / 2,
        }
    }
}

impl<B: Backend> Conv2d<B> {
    pub fn load(vb: &VarBuilder<B>, spec: ConvSpec) -> Result<Self> {
        let k = spec.kernel;
        let weight = vb.param("weight", [spec.c_out, spec.c_in, k, k])?;
        let bias = Some(vb.param("bias", [spec.c_out])?);
        Ok(Self {
            weight,
            bias,
            stride: spec.stride,
            padding: spec.padding,
            groups: 1,
        })
    }

    /// On burn-flex in f32 through [`crate::cpu::conv`] (NCHW, no per-call weight or layout
    /// copies), elsewhere Burn's `conv2d`.
    pub fn forward(&self, x: Tensor<B, 4>) -> Tensor<B, 4> {
        let weight = self.weight.val();
        let bias = self.bias.as_ref().map(|b| b.val());
        let (x, weight, bias) = if self.groups == 1 {
            let geometry = ConvGeometry {
                stride: self.stride,
                padding: self.padding,
            };
            match cpu_conv::conv2d(x, weight, bias, geometry) {
                Ok(out) => return out,
                Err(inputs) => inputs,
            }
        } else {
            (x, weight, bias)
        };
        conv2d(
            x,
            weight,
            bias,
            ConvOptions::new(
                [self.stride, self.stride],
                [self.padding, self.padding],
                [1, 1],
                self.groups,
            ),
        )
    }
}

/// `torch.nn.GroupNorm` over `[N, C, ...]` (statistics in the input dtype, as PyTorch on CPU).
#[derive(Module, Debug)]
pub struct GroupNorm<B: Backend> {
    pub weight: Param<Tensor<B, 1>>,
    pub bias: Param<Tensor<B, 1>>,
    pub num_groups: usize,
    pub eps: f64,
}

impl<B: Backend> GroupNorm<B> {
    pub fn load(vb: &VarBuilder<B>, num_groups: usize, channels: usize, eps: f64) -> Result<Self> {
        if num_groups == 0 || !channels.is_multiple_of(num_groups) {
            return Err(ModelError::Input(format!(
                "group norm `{}`: {channels} channels are not divisible into {num_groups} groups",
                vb.key("weight")
            )));
        }
        Ok(Self {
            weight: vb.param("weight", [channels])?,
            bias: vb.param("bias", [channels])?,
            num_groups,
            eps,
        })
    }

    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let x = match self.cpu_kernel(x, false) {
            Ok(out) => return out,
            Err(x) => x,
        };
        self.forward_burn(x)
    }

    /// `act(self.forward(x))`, fused into one pass on the CPU backend for SiLU (the resnet
    /// blocks' `norm -> act -> conv`).
    pub fn forward_then<const D: usize>(&self, x: Tensor<B, D>, act: Activation) -> Tensor<B, D> {
        if act == Activation::Silu {
            match self.cpu_kernel(x, true) {
                Ok(out) => out,
                Err(x) => act.forward(self.forward_burn(x)),
            }
        } else {
            act.forward(self.forward(x))
        }
    }

    fn cpu_kernel<const D: usize>(
        &self,
        x: Tensor<B, D>,
        silu: bool,
    ) -> std::result::Result<Tensor<B, D>, Tensor<B, D>> {
        cpu_elementwise::group_norm(
            x,
            &self.weight.val(),
            &self.bias.val(),
            self.num_groups,
            self.eps,
            silu,
        )
    }

    fn forward_burn<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let dims = x.dims();
        let (n, c, g) = (dims[0], dims[1], self.num_groups);
        // The statistics in f32 whatever the weights' dtype, as torch's group norm accumulates
        // (an f16 variance overflows past |x| ~ 256), then back to the input's dtype.
        let dtype = crate::dtype::dtype_of(&x);
        let f32 = burn::tensor::FloatDType::F32;
        let grouped: Tensor<B, 3> = x.reshape([n as i64, g as i64, -1]);
        let grouped = crate::dtype::cast_to(grouped, f32);
        let (var, mean) = grouped.clone().var_mean_bias(2);
        // As PyTorch's CPU kernel: per (sample, channel) `scale = weight / std` and
        // `shift = bias - mean * scale`, then one multiply-add over the activations (two passes
        // over the big tensor instead of four).
        let per_channel = |t: Tensor<B, 3>| t.expand([n, g, c / g]).reshape([n, c]);
        let weight = crate::dtype::cast_to(self.weight.val(), f32).reshape([1, c]);
        let bias = crate::dtype::cast_to(self.bias.val(), f32).reshape([1, c]);
        let scale = per_channel(var.add_scalar(self.eps).sqrt().recip()) * weight;
        let shift = bias - per_channel(mean) * scale.clone();
        let flat: Tensor<B, 3> = grouped.reshape([n as i64, c as i64, -1]);
        let out = (flat * scale.reshape([n, c, 1]) + shift.reshape([n, c, 1])).reshape(dims);
        crate::dtype::cast_to(out, dtype)
    }
}

/// `torch.nn.LayerNorm` over the last dimension.
#[derive(Module, Debug)]
pub struct LayerNorm<B: Backend> {
    pub weight: Param<Tensor<B, 1>>,
    pub bias: Param<Tensor<B, 1>>,
    pub eps: f64,
}

impl<B: Backend> LayerNorm<B> {
    pub fn load(vb: &VarBuilder<B>, dim: usize, eps: f64) -> Result<Self> {
        Ok(Self {
            weight: vb.param("weight", [dim])?,
            bias: vb.param("bias", [dim])?,
            eps,
        })
    }

    pub fn forward<const D: usize>(&self, x: Tensor<B, D>) -> Tensor<B, D> {
        let (weight, bias) = (self.weight.val(), self.bias.val());
        let x = match cpu_elementwise::layer_norm(x, Some((&weight, &bias)), self.eps) {
            Ok(out) => return out,
            Err(x) => x,
        };
        let (var, mean) = x.clone().var_mean_bias(D - 1);
        let normed = x.sub(mean).div(var.add_scalar(self.eps).sqrt());
        normed * self.weight.val().unsqueeze() + self.bias.val().unsqueeze()
    }
}

/// `torch.nn.Embedding`.
#[derive(Module, Debug)]
pub struct Embedding<B: Backend> {
    pub weight: Param<Tensor<B, 2>>,
}

impl<B: Backend> Embedding<B> {
    pub fn load(vb: &VarBuilder<B>, count: usize, dim: usize) -> Result<Self> {
        Ok(Self {
            weight: vb.param("weight", [count, dim])?,
        })
    }

    pub fn forward(&self, ids: Tensor<B, 2, Int>) -> Tensor<B, 3> {
        embedding(self.weight.val(), ids)
    }
}

/// The activation functions the configs name (`act_fn`, `hidden_act`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Activation {
    Silu,
    /// Exact (erf) GELU.
    Gelu,
    /// tanh-approximated GELU (`gelu_pytorch_tanh`, `gelu_new`).
    GeluTanh,
    /// `x * sigmoid(1.702 x)`, OpenAI CLIP's activation.
    QuickGelu,
    Relu,
}

impl Activation {
    /// Parses a diffusers/transformers activation name.
    pub fn from_name(name: &str) -> Option<Self> {
        Some(match name {
            "silu" | "swish" => Self::Silu,
            "gelu" => Self::Gelu,
            "gelu_new" | "gelu_pytorch_tanh" | "gelu_fast" | "gelu-approximate" => Self::GeluTanh,
            "quick_gelu" => Self::QuickGelu,
            "relu" => Self::Relu,
            _ => return None,
        })
    }

    /// On burn-flex one parallel pass ([`cpu_elementwise::map`]), elsewhere Burn's activations.
    pub fn forward<B: Backend, const D: usize>(self, x: Tensor<B, D>) -> Tensor<B, D> {
        let cpu = match self {
            Self::Silu => cpu_elementwise::map(x, cpu_elementwise::silu),
            Self::Gelu => cpu_elementwise::map(x, cpu_elementwise::gelu),
            Self::GeluTanh => cpu_elementwise::map(x, cpu_elementwise::gelu_tanh),
            Self::QuickGelu => cpu_elementwise::map(x, cpu_elementwise::quick_gelu),
            Self::Relu => cpu_elementwise::map(x, |v| v.max(0.0)),
        };
        let x = match cpu {
            Ok(out) => return out,
            Err(x) => x,
        };
        match self {
            Self::Silu => silu(x),
            Self::Gelu => activation::gelu(x),
            Self::GeluTanh => activation::gelu_approximate(x),
            Self::QuickGelu => x.clone() * sigmoid(x.mul_scalar(1.702)),
            Self::Relu => activation::relu(x),
        }
    }
}

/// `1 / (1 + e^-x)` in f32 whatever `x`'s dtype, as Burn's own sigmoid, but in one
/// exponential: Burn's default (which the PJRT backends get) is `exp(-log(1 + exp(-x)))`, two
/// exponentials and a logarithm per element, which a compiled program cannot simplify since
/// its scalars are runtime inputs. Where `e^-x` overflows the result is 0, as it should be.
pub fn sigmoid<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    let dtype = crate::dtype::dtype_of(&x);
    let x = crate::dtype::cast_to(x, FloatDType::F32);
    crate::dtype::cast_to(x.neg().exp().add_scalar(1.0).recip(), dtype)
}

/// `x * sigmoid(x)` through [`sigmoid`].
pub fn silu<B: Backend, const D: usize>(x: Tensor<B, D>) -> Tensor<B, D> {
    x.clone() * sigmoid(x)
}

/// Layer norm over the last dimension without learned parameters
/// (`elementwise_affine=False`), as the diffusion transformers' adaptive norms use it.
pub fn layer_norm<B: Backend, const D: usize>(x: Tensor<B, D>, eps: f64) -> Tensor<B, D> {
    let x = match cpu_elementwise::layer_norm(x, None, eps) {
        Ok(out) => return out,
        Err(x) => x,
    };
    let (var, mean) = x.clone().var_mean_bias(D - 1);
    x.sub(mean).div(var.add_scalar(eps).sqrt())
}

/// `a + b` for tensors of one shape (a residual connection): on burn-flex one parallel pass
/// written in place ([`cpu_elementwise::add`]), elsewhere Burn's add. Same bits either way.
pub fn residual_add<B: Backend, const D: usize>(a: Tensor<B, D>, b: Tensor<B, D>) -> Tensor<B, D> {
    match cpu_elementwise::add(a, b) {
        Ok(sum) => sum,
        Err((a, b)) => a + b,
    }
}

/// `x + t` for `x` `[n, c, ...]` and `t` `[n, c]` broadcast over the rest (a ResNet block's time
/// embedding): on burn-flex one pass in place ([`cpu_elementwise::add_per_channel`]),
/// elsewhere Burn's broadcasting add.
pub fn add_per_channel<B: Backend>(x: Tensor<B, 4>, t: Tensor<B, 2>) -> Tensor<B, 4> {
    match cpu_elementwise::add_per_channel(x, t) {
        Ok(sum) => sum,
        Err((x, t)) => x + t.unsqueeze_dim::<3>(2).unsqueeze_dim(3),
    }
}
