//! Moving models between devices: one `to` for every component and pipeline.

use burn::module::{Module, ModuleMapper, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Bool, Int, Tensor};

/// Places a model, or a whole pipeline, on a device: `unet.to(&device)`, `pipe.to(&device)`.
///
/// With the `Oxi` backend of `oxidiff-backend-tpu` the device is parsed from a name:
/// `pipe.to(&"tpu".parse()?)`, `"xla:cpu:1"`, `"cuda"`, `"cpu"`.
pub trait ToDevice<B: Backend>: Sized {
    /// The same model with all its weights on `device`.
    #[must_use]
    fn to(self, device: &B::Device) -> Self;
}

impl<B: Backend, M: Module<B>> ToDevice<B> for M {
    /// Burn's `to_device`, except that a parameter not made yet (a quantized weight's lazy
    /// dense form or device blocks) stays lazy and is moved when it is made: Burn's own would
    /// make it first.
    fn to(self, device: &B::Device) -> Self {
        self.map(&mut Mover(device.clone()))
    }
}

/// Moves every parameter to one device; lazy ones when they are made.
struct Mover<D>(D);

macro_rules! move_param {
    ($self:ident, $param:ident) => {{
        let device = $self.0.clone();
        if $param.is_initialized() {
            $param.map(|t| t.to_device(&device))
        } else {
            $param.init_mapper(move |t| t.to_device(&device))
        }
    }};
}

impl<B: Backend> ModuleMapper<B> for Mover<B::Device> {
    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        move_param!(self, param)
    }

    fn map_int<const D: usize>(
        &mut self,
        param: Param<Tensor<B, D, Int>>,
    ) -> Param<Tensor<B, D, Int>> {
        move_param!(self, param)
    }

    fn map_bool<const D: usize>(
        &mut self,
        param: Param<Tensor<B, D, Bool>>,
    ) -> Param<Tensor<B, D, Bool>> {
        move_param!(self, param)
    }
}
