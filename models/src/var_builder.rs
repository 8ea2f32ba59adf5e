//! [`VarBuilder`]: layers built from [`Weights`] by key path, as candle's `VarBuilder`; and the
//! one way every model's `from_dir_in` loads its component folder ([`load_component`]).

use std::path::Path;
use std::sync::{Arc, OnceLock};

use burn::module::{Param, ParamId};
use burn::tensor::backend::Backend;
use burn::tensor::{FloatDType, Shape, Tensor, TensorData};

use crate::cpu::common::is_flex;
use crate::error::{ModelError, Result};
use crate::gguf::QuantizedMatrix;
use crate::weights::{Defer, WeightRead, Weights};

/// Builds layers from weights by key path, on one device, holding float weights in one dtype
/// (f32 unless [`with_dtype`](Self::with_dtype) says otherwise).
#[derive(Clone)]
pub struct VarBuilder<B: Backend> {
    weights: Arc<Weights>,
    prefix: String,
    device: B::Device,
    dtype: FloatDType,
    upload: Upload,
}

/// When a weight read for a device (not the CPU backend, whose weights stay in the mapped file)
/// is uploaded to it.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum Upload {
    /// While the model loads: its first call finds every weight in place.
    AtLoad,
    /// At the weight's first use: a part many pipelines never run (the VAE's encoder in text to
    /// image) takes no device memory and no load time there.
    AtFirstUse,
}

impl<B: Backend> VarBuilder<B> {
    pub fn new(weights: Arc<Weights>, device: &B::Device) -> Self {
        Self {
            weights,
            prefix: String::new(),
            device: device.clone(),
            dtype: FloatDType::F32,
            upload: Upload::AtLoad,
        }
    }

    /// The same builder uploading its weights to a device at their first use
    /// ([`Upload::AtFirstUse`]).
    #[must_use]
    pub fn uploaded_at_first_use(mut self) -> Self {
        self.upload = Upload::AtFirstUse;
        self
    }

    /// The same builder holding weights in `dtype` (diffusers' `torch_dtype`): each tensor is
    /// read straight into it, shared with the file when stored in it, else converted once.
    #[must_use]
    pub fn with_dtype(mut self, dtype: FloatDType) -> Self {
        self.dtype = dtype;
        self
    }

    /// The dtype float weights are held in.
    pub fn dtype(&self) -> FloatDType {
        self.dtype
    }

    /// A builder one level down: `vb.pp("down_blocks").pp(0)`.
    pub fn pp(&self, name: impl std::fmt::Display) -> Self {
        let prefix = if self.prefix.is_empty() {
            name.to_string()
        } else {
            format!("{}.{}", self.prefix, name)
        };
        Self {
            weights: self.weights.clone(),
            prefix,
            device: self.device.clone(),
            dtype: self.dtype,
            upload: self.upload,
        }
    }

    pub fn device(&self) -> &B::Device {
        &self.device
    }

    pub fn weights(&self) -> &Arc<Weights> {
        &self.weights
    }

    /// Full key of `name` under this builder's prefix.
    pub fn key(&self, name: &str) -> String {
        if self.prefix.is_empty() {
            name.to_string()
        } else {
            format!("{}.{}", self.prefix, name)
        }
    }

    pub fn contains(&self, name: &str) -> bool {
        self.weights.contains(&self.key(name))
    }

    /// The error for `key` found with shape `found` where `expected` was needed.
    fn misfit(&self, key: String, expected: &[usize], found: Vec<usize>) -> ModelError {
        ModelError::ShapeMismatch {
            path: self.weights.path_of(&key),
            key,
            expected: expected.to_vec(),
            found,
        }
    }

    /// Reads `name` as host f32 values, checking the shape.
    pub fn get_host(&self, name: &str, shape: &[usize]) -> Result<Vec<f32>> {
        let key = self.key(name);
        let (values, found) = self.weights.read_f32(&key)?;
        if found != shape {
            return Err(self.misfit(key, shape, found));
        }
        Ok(values)
    }

    /// Loads a PyTorch `[out, in]` linear weight as Burn's `[in, out]`: the stored tensor,
    /// transposed as a view (no copy), which the matrix products read in place through its
    /// strides.
    pub fn get_linear_weight(&self, name: &str, d_in: usize, d_out: usize) -> Result<Tensor<B, 2>> {
        Ok(self.get(name, [d_out, d_in])?.transpose())
    }

    /// The GGML blocks of the `[d_out, d_in]` linear weight `name`, when it is stored quantized
    /// (from a GGUF file); `None` when it is plain floats.
    pub fn get_quantized_linear(
        &self,
        name: &str,
        d_in: usize,
        d_out: usize,
    ) -> Result<Option<QuantizedMatrix>> {
        let key = self.key(name);
        match self.weights.shape(&key) {
            Some(found) if found != [d_out, d_in] => {
                let found = found.to_vec();
                Err(self.misfit(key, &[d_out, d_in], found))
            }
            Some(_) => self.weights.quantized(&key),
            None => Ok(None),
        }
    }

    /// Loads `name` as a tensor of the expected shape, in this builder's dtype.
    pub fn get<const D: usize>(&self, name: &str, shape: [usize; D]) -> Result<Tensor<B, D>> {
        let key = self.checked_key(name, &shape)?;
        Ok(tensor(self.weights.read(&key, self.dtype)?, &self.device))
    }

    /// `name` as a parameter of the expected shape, in this builder's dtype. On the CPU backend
    /// a tensor that must be converted (an fp16 checkpoint held in bf16) is found and checked
    /// now but converted at its first use ([`PendingRead`]), as the mapped f32 or f16 file
    /// itself is only read then; a weight never used is never converted.
    pub fn param<const D: usize>(
        &self,
        name: &str,
        shape: [usize; D],
    ) -> Result<Param<Tensor<B, D>>> {
        let key = self.checked_key(name, &shape)?;
        Ok(match self.read_deferred(&key)? {
            WeightRead::Ready(data) => Param::from_tensor(tensor(data, &self.device)),
            WeightRead::Pending(pending) => lazy_param(shape, self.device.clone(), move |device| {
                tensor(pending.read(), device)
            }),
        })
    }

    /// [`get_linear_weight`](Self::get_linear_weight) as a parameter, converted at its first
    /// use as [`param`](Self::param) says.
    pub fn linear_weight_param(
        &self,
        name: &str,
        d_in: usize,
        d_out: usize,
    ) -> Result<Param<Tensor<B, 2>>> {
        let key = self.checked_key(name, &[d_out, d_in])?;
        Ok(match self.read_deferred(&key)? {
            WeightRead::Ready(data) => {
                Param::from_tensor(tensor::<B, 2>(data, &self.device).transpose())
            }
            WeightRead::Pending(pending) => {
                lazy_param([d_in, d_out], self.device.clone(), move |device| {
                    tensor::<B, 2>(pending.read(), device).transpose()
                })
            }
        })
    }

    /// The full key of `name`, checked to hold a tensor of `shape` when it is present.
    fn checked_key(&self, name: &str, shape: &[usize]) -> Result<String> {
        let key = self.key(name);
        match self.weights.shape(&key) {
            Some(found) if found != shape => {
                let found = found.to_vec();
                Err(self.misfit(key, shape, found))
            }
            _ => Ok(key),
        }
    }

    /// `key` read now, or at its first use: on the CPU backend when it must be converted, on a
    /// device when this builder uploads at first use.
    fn read_deferred(&self, key: &str) -> Result<WeightRead> {
        if is_flex::<B>() {
            return self
                .weights
                .read_deferred(key, self.dtype, Defer::WhenConverted);
        }
        match self.upload {
            // Uploaded (or staged for their shards) at load.
            Upload::AtLoad => Ok(WeightRead::Ready(self.weights.read(key, self.dtype)?)),
            Upload::AtFirstUse => self.weights.read_deferred(key, self.dtype, Defer::Always),
        }
    }
}

/// `data` as a tensor on `device`, in the data's own dtype (without one, Burn converts to the
/// device's default, f32).
fn tensor<B: Backend, const D: usize>(data: TensorData, device: &B::Device) -> Tensor<B, D> {
    let dtype = data.dtype;
    Tensor::from_data(data, (device, dtype))
}

/// A parameter of `shape` made by `make` when first used. Clones made before that (a module
/// cloned at load) share the one tensor `make` returns, as clones of a made tensor share its
/// storage.
pub(crate) fn lazy_param<B: Backend, const D: usize>(
    shape: [usize; D],
    device: B::Device,
    make: impl Fn(&B::Device) -> Tensor<B, D> + Send + Sync + 'static,
) -> Param<Tensor<B, D>> {
    let made: OnceLock<Tensor<B, D>> = OnceLock::new();
    Param::uninitialized(
        ParamId::new(),
        move |device, _| made.get_or_init(|| make(device)).clone(),
        device,
        false,
        Shape::new(shape),
    )
}

/// A model built from a component folder the way every model's `from_dir_in` does it: the
/// weights named `bases` (and `variant`) read into `dtype` by `build`, then what the model
/// computed at load in f32 (sinusoidal tables) cast into `dtype` too.
pub(crate) fn load_component<B: Backend, M: burn::module::Module<B>>(
    dir: &Path,
    bases: &[&str],
    variant: Option<&str>,
    dtype: FloatDType,
    device: &B::Device,
    build: impl FnOnce(VarBuilder<B>) -> Result<M>,
) -> Result<M> {
    let weights = Weights::from_component_dir(dir, bases, variant)?;
    build_component(weights, dtype, device, build)
}

/// A model built by `build` from `weights` held in `dtype`, then what it computed at load cast
/// into `dtype` (the second half of [`load_component`], for weights from elsewhere: a GGUF file).
pub fn build_component<B: Backend, M: burn::module::Module<B>>(
    weights: Weights,
    dtype: FloatDType,
    device: &B::Device,
    build: impl FnOnce(VarBuilder<B>) -> Result<M>,
) -> Result<M> {
    use crate::dtype::ToDType;
    let model = build(VarBuilder::new(Arc::new(weights), device).with_dtype(dtype))?;
    Ok(model.to_dtype(dtype))
}
