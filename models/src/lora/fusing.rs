//! Fusing a LoRA into a model: [`plan`] resolves a file's layers against the model (every key
//! must name a layer of the right shape), [`fuse`] adds `scale * alpha / rank * up @ down` to
//! each weight, as diffusers' `fuse_lora(lora_scale=scale)`.

use std::collections::HashMap;

use burn::module::{ModuleMapper, Param};
use burn::tensor::backend::Backend;
use burn::tensor::{Tensor, TensorData};

use super::file::{list, LoraComponent, LoraFile, LoraFormat, LoraLayer};
use super::keys::{
    lora_modules, split_layer, LoraLayerKind, LoraModule, LoraTarget, PathTracker, SplitError,
};
use crate::error::{ModelError, Result};

/// One layer's update: `factor * up @ down`, shaped for the Burn weight.
#[derive(Debug, Clone)]
struct Delta {
    up: Vec<f32>,
    down: Vec<f32>,
    rank: usize,
    kind: LoraLayerKind,
    factor: f32,
}

impl Delta {
    /// `up x down x factor`: the update of the checkpoint's weight, `[out, fan_in]`.
    fn product<B: Backend>(&self, device: &B::Device) -> Tensor<B, 2> {
        let (out, fan_in) = (self.kind.out(), self.kind.fan_in());
        let up =
            Tensor::<B, 2>::from_data(TensorData::new(self.up.clone(), [out, self.rank]), device);
        let down = Tensor::<B, 2>::from_data(
            TensorData::new(self.down.clone(), [self.rank, fan_in]),
            device,
        );
        up.matmul(down).mul_scalar(self.factor)
    }

    /// `weight` with the update added, in the weight's dtype. A Linear holds its `[in, out]`
    /// weight as a transposed view of the checkpoint's `[out, in]`; the update is added in that
    /// orientation and the sum viewed back, so the weight keeps the layout it was loaded with
    /// (and a matrix product sums it in the same order: a scale of 0 changes no bit).
    fn add_to<B: Backend, const D: usize>(&self, weight: Tensor<B, D>) -> Tensor<B, D> {
        let dtype = weight.dtype();
        let update = self.product::<B>(&weight.device());
        match self.kind {
            LoraLayerKind::Linear { .. } => {
                let stored = weight.transpose();
                let update = update.reshape(stored.dims()).cast(dtype);
                (stored + update).transpose()
            }
            LoraLayerKind::Conv { .. } => {
                let update = update.reshape(weight.dims()).cast(dtype);
                weight + update
            }
        }
    }
}

/// A LoRA's layers for one model, resolved and shape-checked; [`fuse`] applies it.
#[derive(Debug, Clone, Default)]
pub struct LoraPlan {
    deltas: HashMap<String, Delta>,
}

impl LoraPlan {
    /// How many layers it changes.
    pub fn len(&self) -> usize {
        self.deltas.len()
    }

    pub fn is_empty(&self) -> bool {
        self.deltas.is_empty()
    }
}

/// Resolves `file`'s layers for `component` against `model` (scaled by `scale`). Every layer
/// must name an existing Linear or Conv2d of matching shape; otherwise the error lists each
/// key that does not fit, with both shapes (a LoRA for another architecture fails here, before
/// any weight changes).
pub fn plan<B: Backend, M: LoraTarget<B>>(
    model: &M,
    file: &LoraFile,
    component: LoraComponent,
    scale: f32,
) -> Result<LoraPlan> {
    let layers = file.layers_of(component);
    if layers.is_empty() {
        return Ok(LoraPlan::default());
    }
    let modules = lora_modules(model);
    let mut by_name: HashMap<String, &LoraModule> = HashMap::new();
    for module in &modules {
        match file.format {
            LoraFormat::Diffusers => by_name.insert(module.name.clone(), module),
            LoraFormat::Kohya => by_name.insert(module.name.replace('.', "_"), module),
        };
    }
    let find = |name: &str| {
        by_name
            .get(name)
            .copied()
            .or_else(|| {
                name.strip_prefix("text_model.")
                    .or_else(|| name.strip_prefix("text_model_"))
                    .and_then(|n| by_name.get(n).copied())
            })
            .or_else(|| {
                let alias = (file.format == LoraFormat::Kohya)
                    .then(|| model.kohya_alias(name))
                    .flatten()?;
                by_name.get(&alias).copied()
            })
    };
    let mut deltas = HashMap::new();
    let (mut misfits, mut absent) = (Vec::new(), Vec::new());
    let mut resolved: Vec<(std::borrow::Cow<LoraLayer>, &LoraModule)> = Vec::new();
    for layer in layers {
        if let Some(module) = find(&layer.name) {
            resolved.push((std::borrow::Cow::Borrowed(layer), module));
            continue;
        }
        let split = (file.format == LoraFormat::Kohya)
            .then(|| model.kohya_split(&layer.name))
            .flatten();
        let Some(split) = split else {
            absent.push(format!("`{}`", layer.key));
            continue;
        };
        match split_layer(layer, &split, |name| by_name.get(name).copied()) {
            Ok(parts) => resolved.extend(
                parts
                    .into_iter()
                    .map(|(part, module)| (std::borrow::Cow::Owned(part), module)),
            ),
            Err(SplitError::Absent(name)) => {
                absent.push(format!("`{}` (its part `{name}`)", layer.key))
            }
            Err(SplitError::Rows(targets)) => misfits.push(format!(
                "`{}` (up {:?}) against `{}` together",
                layer.key, layer.up.1, targets
            )),
        }
    }
    for (layer, module) in resolved {
        if module.quantized {
            return Err(ModelError::Lora {
                path: file.path.clone(),
                reason: format!(
                    "`{}` targets `{}`, whose weight is held in quantized GGUF blocks; a LoRA \
                     cannot be fused into those, and applying one at run time is not supported \
                     yet: load the {} from a safetensors checkpoint to use this LoRA. Nothing \
                     was fused",
                    layer.key,
                    module.name,
                    component.name()
                ),
            });
        }
        let (kind, rank) = (module.kind, layer.rank());
        // Checked: a hostile header may pair a zero dimension with huge ones.
        let down_fan_in = layer.down.1[1..]
            .iter()
            .try_fold(1usize, |n, &d| n.checked_mul(d))
            .unwrap_or(usize::MAX);
        let fits = down_fan_in == kind.fan_in()
            && layer.up.1[0] == kind.out()
            && match kind {
                LoraLayerKind::Linear { .. } => layer.down.1[2..].iter().all(|&d| d == 1),
                LoraLayerKind::Conv { c_in, kernel, .. } => {
                    layer.down.1.len() == 2 || layer.down.1[1..] == [c_in, kernel, kernel]
                }
            };
        if !fits {
            misfits.push(format!(
                "`{}` (down {:?}, up {:?}) against `{}` of shape {:?}",
                layer.key,
                layer.down.1,
                layer.up.1,
                module.name,
                kind.torch_shape()
            ));
            continue;
        }
        if deltas.contains_key(&module.path) {
            misfits.push(format!(
                "`{}`: a second LoRA pair for layer `{}`",
                layer.key, module.name
            ));
            continue;
        }
        deltas.insert(
            module.path.clone(),
            Delta {
                up: layer.up.0.clone(),
                down: layer.down.0.clone(),
                rank,
                kind,
                factor: scale * layer.scaling,
            },
        );
    }
    if !misfits.is_empty() || !absent.is_empty() {
        let mut parts = Vec::new();
        if !misfits.is_empty() {
            parts.push(format!("shapes that do not fit: {}", list(&misfits)));
        }
        if !absent.is_empty() {
            parts.push(format!(
                "layers the {} does not have: {}",
                component.name(),
                list(&absent)
            ));
        }
        return Err(ModelError::Lora {
            path: file.path.clone(),
            reason: format!(
                "{} of its {} {} layers do not match this model (is the LoRA for another \
                 model, e.g. SD 1.x against SDXL?); nothing was fused. {}",
                misfits.len() + absent.len(),
                layers.len(),
                component.name(),
                parts.join(". ")
            ),
        });
    }
    Ok(LoraPlan { deltas })
}

struct Fuser<'a> {
    tracker: PathTracker,
    plan: &'a LoraPlan,
    applied: usize,
}

impl<B: Backend> ModuleMapper<B> for Fuser<'_> {
    fn enter_module(&mut self, name: &str, container_type: &str) {
        self.tracker.enter(name, container_type);
    }

    fn exit_module(&mut self, _name: &str, _container_type: &str) {
        self.tracker.exit();
    }

    fn map_float<const D: usize>(&mut self, param: Param<Tensor<B, D>>) -> Param<Tensor<B, D>> {
        let Some(delta) = self.plan.deltas.get(&self.tracker.path()) else {
            return param;
        };
        self.applied += 1;
        param.map(|weight| delta.add_to(weight))
    }
}

/// Adds a planned LoRA to `model`'s weights (on their devices, in their dtype). Returns the
/// model and how many layers changed.
pub fn fuse<B: Backend, M: LoraTarget<B>>(model: M, plan: &LoraPlan) -> (M, usize) {
    if plan.is_empty() {
        return (model, 0);
    }
    let mut fuser = Fuser {
        tracker: PathTracker::default(),
        plan,
        applied: 0,
    };
    let model = model.map(&mut fuser);
    let applied = fuser.applied;
    (model, applied)
}
