//! `x W + b` in bf16 on AMX for burn-flex, used by [`crate::nn::Linear`]: the rows of `x` are the
//! left side of a [`super::half_gemm`] product read in place, the weight `[in, out]` is packed
//! into AMX's pair layout once and kept while the weight lives, and the f32 sums are rounded
//! once into the bf16 output with the bias added.
//!
//! Packing the weight on every call would read and write it once per call, as much memory
//! traffic as the product itself for the short sequences of the deep UNet levels and the text
//! encoder. The packed copies are keyed by the weight's storage and dropped once that storage
//! is gone; the cache holds the storage only weakly, and since burn-flex writes in place only
//! through storage nobody else references (`Arc::get_mut`, `Arc::make_mut`), a weight changed in
//! place (a fused LoRA) moves to new storage and gets a new packing.

use std::collections::HashMap;
use std::sync::{Arc, Mutex, Weak};

use burn::tensor::backend::Backend;
use burn::tensor::{Bytes, DType, Tensor};
use burn_flex::{FlexTensor, Layout};
use half::bf16;

use super::amx;
use super::common::{from_flex, into_flex, is_flex, round_bf16, widen, OutPtr};
use super::half_gemm::{self, PackedB};

/// The inputs handed back when [`linear`] does not apply.
pub type Unhandled<B, const D: usize> = (Tensor<B, D>, Tensor<B, 2>, Option<Tensor<B, 1>>);

/// `x W + b` for `x` `[..., in]`, `weight` `[in, out]`, `bias` `[out]`, when the backend is
/// burn-flex, all three are bf16 and AMX is available; otherwise the inputs untouched (`Err`) for
/// Burn's `linear`.
pub fn linear<B: Backend, const D: usize>(
    x: Tensor<B, D>,
    weight: Tensor<B, 2>,
    bias: Option<Tensor<B, 1>>,
) -> Result<Tensor<B, D>, Unhandled<B, D>> {
    let bf16_only = x.dtype() == DType::BF16
        && weight.dtype() == DType::BF16
        && bias.as_ref().is_none_or(|b| b.dtype() == DType::BF16);
    let [d_in, d_out] = weight.dims();
    if !is_flex::<B>()
        || !bf16_only
        || !amx::available()
        || x.dims()[D - 1] != d_in
        || bias.as_ref().is_some_and(|b| b.dims()[0] != d_out)
    {
        return Err((x, weight, bias));
    }
    let mut shape = x.dims().to_vec();
    let x = into_flex(x).to_contiguous();
    let weight = into_flex(weight);
    let bias: Vec<f32> = match bias {
        Some(b) => widen(&into_flex(b)).storage::<f32>().to_vec(),
        None => vec![0.0; d_out],
    };
    let m = x.layout().num_elements() / d_in.max(1);
    let packed = packed_weight(&weight);
    let mut out = vec![bf16::ZERO; m * d_out];
    let ptr = OutPtr(out.as_mut_ptr());
    half_gemm::gemm(x.storage::<bf16>(), d_in, m, &packed, |block| {
        for i in 0..block.rows {
            let at = (block.row0 + i) * d_out + block.col0;
            // SAFETY: blocks are disjoint parts of `out`.
            let dst = unsafe { std::slice::from_raw_parts_mut(ptr.add(at).0, block.cols) };
            let bias = &bias[block.col0..block.col0 + block.cols];
            for ((d, v), b) in dst.iter_mut().zip(block.row(i)).zip(bias) {
                *d = round_bf16(v + b);
            }
        }
    });
    shape[D - 1] = d_out;
    Ok(from_flex(FlexTensor::new(
        Bytes::from_elems(out),
        Layout::contiguous(shape.into()),
        DType::BF16,
    )))
}

/// Where a weight's values lie: its storage, and its layout in it.
#[derive(Clone, PartialEq, Eq, Hash)]
struct WeightKey {
    storage: usize,
    offset: usize,
    shape: [usize; 2],
    strides: Vec<isize>,
}

struct CacheEntry {
    owner: Weak<Bytes>,
    packed: Arc<PackedB>,
}

/// The packed form of `weight` `[in, out]`, from the cache when this storage was packed before.
fn packed_weight(weight: &FlexTensor) -> Arc<PackedB> {
    static CACHE: Mutex<Option<HashMap<WeightKey, CacheEntry>>> = Mutex::new(None);
    let storage = weight.data_arc();
    let layout = weight.layout();
    let shape = [layout.shape()[0], layout.shape()[1]];
    let key = WeightKey {
        storage: Arc::as_ptr(&storage) as usize,
        offset: layout.start_offset(),
        shape,
        strides: layout.strides().to_vec(),
    };
    {
        let cache = CACHE.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(entry) = cache.as_ref().and_then(|c| c.get(&key)) {
            if entry
                .owner
                .upgrade()
                .is_some_and(|o| Arc::ptr_eq(&o, &storage))
            {
                return entry.packed.clone();
            }
        }
    }
    let contiguous = weight.to_contiguous();
    let packed = Arc::new(PackedB::from_rows(
        contiguous.storage::<bf16>(),
        shape[1],
        shape[0],
        shape[1],
    ));
    let mut cache = CACHE.lock().unwrap_or_else(|e| e.into_inner());
    let cache = cache.get_or_insert_with(HashMap::new);
    cache.retain(|_, entry| entry.owner.strong_count() > 0);
    cache.insert(
        key,
        CacheEntry {
            owner: Arc::downgrade(&storage),
            packed: packed.clone(),
        },
    );
    packed
}
