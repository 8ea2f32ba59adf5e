//! Moving models between devices: one `to` for every component and pipeline.

use burn::module::Module;
use burn::tensor::backend::Backend;

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
    fn to(self, device: &B::Device) -> Self {
        self.to_device(device)
    }
}
