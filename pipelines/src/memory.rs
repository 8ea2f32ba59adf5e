//! What each component of a pipeline holds, and where ([`WeightMemory`]): `txt2img --json`'s
//! `memory`.

use burn::module::Module;
use burn::tensor::backend::Backend;
pub use oxidiff_models::memory::{QuantizedBytes, WeightMemory, HOST};

/// One component's weights (`text_encoder`, `unet`, `vae`, ...).
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ComponentMemory {
    pub component: String,
    pub memory: WeightMemory,
}

/// How a pipeline names the place of a device in [`ComponentMemory`]: [`HOST`] for the CPU, a
/// PJRT device's own name otherwise.
pub type PlaceName<'a, D> = &'a dyn Fn(&D) -> String;

/// `module`'s weights as component `name`, plus its GGUF blocks (`quantized`).
pub(crate) fn component_memory<B: Backend, M: Module<B>>(
    name: &str,
    module: &M,
    quantized: Option<&QuantizedBytes>,
    place: PlaceName<'_, B::Device>,
) -> ComponentMemory {
    let mut memory = WeightMemory::of::<B, M>(module, place);
    if let Some(quantized) = quantized {
        memory = memory.with_quantized(quantized);
    }
    ComponentMemory {
        component: name.to_string(),
        memory,
    }
}
