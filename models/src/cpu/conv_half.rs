//! 2-D convolution in bf16 and f16 for burn-flex, used by [`super::conv::conv2d`]. In bf16
//! where [`super::half_gemm`] runs (AMX or AVX512-BF16): Winograd ([`super::winograd`]) for the
//! 3x3 stride-1 convolutions the f32 kernel takes it for; otherwise the weight
//! `[c_out, c_in * k * k]` read in place as the left side of a [`super::half_gemm`] product,
//! tiles of output rows unrolled into bf16 columns on the right, f32 sums rounded once into the
//! output with the bias added. Elsewhere (and in f16), the tensors widened to f32 for the f32
//! kernel and its result rounded back.

use half::bf16;

use burn::tensor::{Bytes, DType};
use burn_flex::{FlexTensor, Layout};

use super::common::{narrow, round_bf16_affine, widen, zeroed_bf16, OutPtr};
use super::conv_f32::{conv2d_nchw_f32, ConvGeometry, ConvPath, ConvShape, Im2col, Winograd};
use super::half_gemm::{self, PackedB};
use super::winograd;

/// Output positions per tile: its packed columns (`c_in * k * k` values each) stay near the L2
/// cache while every block of output channels is multiplied with them.
const TILE_COLUMNS: usize = 512;

/// Convolves half-precision `x` `[n, c_in, h, w]` with `weight` `[c_out, c_in, k, k]` and
/// `bias` `[c_out]` (the caller checked shapes and dtypes: all `x`'s dtype, bf16 or f16).
pub(crate) fn conv2d_half(
    x: &FlexTensor,
    weight: &FlexTensor,
    bias: Option<&FlexTensor>,
    geometry: ConvGeometry,
    path: ConvPath,
) -> FlexTensor {
    let dtype = x.dtype();
    if dtype == DType::BF16 && half_gemm::available() {
        return conv2d_bf16_gemm(x, weight, bias, geometry, path);
    }
    let out = conv2d_nchw_f32(
        &widen(x),
        &widen(weight),
        bias.map(widen).as_ref(),
        geometry,
        path,
    );
    narrow(out, dtype)
}

fn conv2d_bf16_gemm(
    x: &FlexTensor,
    weight: &FlexTensor,
    bias: Option<&FlexTensor>,
    geometry: ConvGeometry,
    path: ConvPath,
) -> FlexTensor {
    let x = x.to_contiguous();
    let weight = weight.to_contiguous();
    let shape = ConvShape::of(&x, &weight, geometry);
    let ConvShape {
        n,
        c_in,
        h,
        w,
        c_out,
        k,
        s,
        p,
        h_out,
        w_out,
    } = shape;
    let plane_out = h_out * w_out;
    let bias: Vec<f32> = match bias {
        Some(b) => widen(b).storage::<f32>().to_vec(),
        None => vec![0.0; c_out],
    };
    let mut out = zeroed_bf16(n * c_out * plane_out);
    if let Some(Winograd::F2(size)) = shape.winograd(path, 2) {
        let u = winograd::weight_bf16(&weight, c_out, c_in, size);
        winograd::conv_bf16(x.storage(), &u, &bias, &mut out, &shape);
        return FlexTensor::new(
            Bytes::from_elems(out),
            Layout::contiguous(vec![n, c_out, h_out, w_out].into()),
            DType::BF16,
        );
    }
    let geometry = Im2col {
        h,
        w,
        k,
        s,
        p,
        w_out,
    };
    let col_len = c_in * k * k;
    let pointwise = k == 1 && s == 1 && p == 0;
    let rows_per_tile = (TILE_COLUMNS / w_out.max(1)).clamp(1, h_out.max(1));
    let x_all = x.storage::<bf16>();
    let w_all = weight.storage::<bf16>();
    let product = Product {
        weight: w_all,
        col_len,
        c_out,
        plane_out,
        bias: &bias,
        out: OutPtr(out.as_mut_ptr()),
    };
    if n > 1 && n * plane_out <= TILE_COLUMNS {
        // Small planes (a UNet's 8x8 and 4x4 levels): every sample's columns in one product,
        // so the weight is read once rather than once per sample, and 16-position planes fill
        // the product's 32-column blocks. Each column's sums do not depend on its neighbours,
        // so a sample's output is the same as when convolved alone.
        let cols = n * plane_out;
        let mut col = zeroed_bf16(col_len * cols);
        let mut one = zeroed_bf16(if pointwise { 0 } else { col_len * plane_out });
        for b in 0..n {
            let x = &x_all[b * c_in * h * w..(b + 1) * c_in * h * w];
            let src: &[bf16] = if pointwise {
                x
            } else {
                geometry.gather_parallel(&mut one, x, 0, h_out);
                &one
            };
            for (dst, src) in col.chunks_exact_mut(cols).zip(src.chunks_exact(plane_out)) {
                dst[b * plane_out..(b + 1) * plane_out].copy_from_slice(src);
            }
        }
        let packed = PackedB::from_rows(&col, cols, col_len, cols);
        product.run(&packed, 0);
        return FlexTensor::new(
            Bytes::from_elems(out),
            Layout::contiguous(vec![n, c_out, h_out, w_out].into()),
            DType::BF16,
        );
    }
    let mut col = Vec::new();
    for b in 0..n {
        let x = &x_all[b * c_in * h * w..(b + 1) * c_in * h * w];
        let mut row0 = 0;
        while row0 < h_out {
            let row1 = (row0 + rows_per_tile).min(h_out);
            let cols = (row1 - row0) * w_out;
            let packed = if pointwise {
                PackedB::from_rows(&x[row0 * w..], h * w, col_len, cols)
            } else {
                col.resize(col_len * cols, bf16::ZERO);
                geometry.gather_parallel(&mut col, x, row0, row1);
                PackedB::from_rows(&col, cols, col_len, cols)
            };
            product.run(&packed, b * plane_out + row0 * w_out);
            row0 = row1;
        }
    }
    FlexTensor::new(
        Bytes::from_elems(out),
        Layout::contiguous(vec![n, c_out, h_out, w_out].into()),
        DType::BF16,
    )
}

/// The product of a convolution's weight `[c_out, col_len]` with packed columns, each column
/// one output position, stored with the bias into the output `[n, c_out, plane_out]`.
struct Product<'a> {
    weight: &'a [bf16],
    col_len: usize,
    c_out: usize,
    plane_out: usize,
    bias: &'a [f32],
    out: OutPtr<bf16>,
}

impl Product<'_> {
    /// `weight x columns`, column `j` being output position `start + j` counted over the
    /// samples' planes one after another (`sample * plane_out + position`): one sample's rows
    /// or several samples' whole planes.
    fn run(&self, columns: &PackedB, start: usize) {
        let Self {
            c_out,
            plane_out,
            bias,
            out,
            ..
        } = *self;
        half_gemm::gemm(
            self.weight,
            self.col_len,
            c_out,
            columns,
            #[inline(always)]
            |block| {
                for i in 0..block.rows {
                    let channel = block.row0 + i;
                    let bias = bias[channel];
                    let values = block.row(i);
                    let mut j = 0;
                    while j < block.cols {
                        let column = start + block.col0 + j;
                        let (sample, position) = (column / plane_out, column % plane_out);
                        let len = (plane_out - position).min(block.cols - j);
                        let at = (sample * c_out + channel) * plane_out + position;
                        // SAFETY: blocks are disjoint (channel, column) ranges of the output,
                        // a column being one (sample, position), inside `out`.
                        let dst = unsafe { std::slice::from_raw_parts_mut(out.add(at).0, len) };
                        round_bf16_affine(&values[j..j + len], 1.0, bias, dst);
                        j += len;
                    }
                }
            },
        );
    }
}
