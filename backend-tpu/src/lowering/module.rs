//! Lowerings of Burn's module ops and linear algebra: matmul, linear,
//! convolutions and their transposes, pools, interpolation, attention.

use std::fmt::Write as _;

use burn_ir::{AttentionOpIr, InterpolateModeIr, ModuleOperationIr, ScalarIr, TensorIr};

use super::{
    emit::i64_array, emit::list, emit::lowest, emit::lowest_finite, emit::min_positive, is_float,
    Lowerer, Result, TensorType, Value,
};
use crate::pjrt::ElementType;

impl Lowerer {
    /// Batched matmul `[..., m, k] x [..., k, n]`, batch dims broadcast.
    pub(super) fn matmul(&mut self, lhs: &TensorIr, rhs: &TensorIr, out: &TensorIr) -> Result<()> {
        let a = self.input(lhs)?;
        let b = self.input(rhs)?;
        let out_dims = out.shape.to_vec();
        let rank = out_dims.len();
        if rank < 2 || a.ty.rank() != rank || b.ty.rank() != rank {
            return self.unsupported("matmul of tensors of different ranks or rank < 2");
        }
        let batch = &out_dims[..rank - 2];
        let (m, k, n) = (
            a.ty.dims[rank - 2],
            a.ty.dims[rank - 1],
            b.ty.dims[rank - 1],
        );
        // A right side shared by every batch (its batch dimensions all 1) is one matrix.
        if b.ty.dims[..rank - 2].iter().all(|&d| d == 1)
            && self.host_matmul_takes(&a.ty, &b.ty.with_dims(vec![k, n]))
        {
            let a = self.broadcast(&a, &[batch, &[m, k]].concat());
            let rhs = self.reshape(&b, &[k, n]);
            let y = self.host_matmul(&a, &rhs, None);
            return self.bind(out, y);
        }
        let a = self.broadcast(&a, &[batch, &[m, k]].concat());
        let b = self.broadcast(&b, &[batch, &[k, n]].concat());
        let b = self.convert(&b, a.ty.elem);
        let batch_dims = (0..rank - 2).collect::<Vec<_>>();
        let y = self.dot_general(
            &a,
            &b,
            (&batch_dims, &batch_dims),
            (&[rank - 1], &[rank - 2]),
            out_dims,
        );
        self.bind(out, y)
    }

    /// Whether `x w` for `x` `[..., k]` and `w` `[k, n]` goes to the host kernel
    /// [`MATMUL_F32`](crate::host_kernels::MATMUL_F32) ([`Lowerer::with_host_kernels`]): both
    /// f32, every dimension at least 1.
    fn host_matmul_takes(&self, x: &TensorType, w: &TensorType) -> bool {
        let rank = x.rank();
        self.host_kernel(crate::host_kernels::MATMUL_F32)
            && x.elem == ElementType::F32
            && w.elem == ElementType::F32
            && rank >= 1
            && w.rank() == 2
            && x.dims[rank - 1] == w.dims[0]
            && x.dims.iter().chain(&w.dims).all(|&d| d > 0)
    }

    /// `x w (+ bias)` as a call of the host kernel on `x`'s rows (its leading dimensions
    /// flattened), where [`Self::host_matmul_takes`] holds.
    fn host_matmul(&mut self, x: &Value, w: &Value, bias: Option<&Value>) -> Value {
        let rank = x.ty.rank();
        let (k, n) = (w.ty.dims[0], w.ty.dims[1]);
        let m = x.ty.dims[..rank - 1].iter().product::<usize>();
        let rows = self.reshape(x, &[m, k]);
        let ty = x.ty.with_dims(vec![m, n]);
        let operands = [Some(&rows), Some(w), bias].into_iter().flatten();
        let y = self.host_call(crate::host_kernels::MATMUL_F32, operands, "", ty);
        let mut dims = x.ty.dims.clone();
        dims[rank - 1] = n;
        self.reshape(&y, &dims)
    }

    pub(super) fn lower_module(&mut self, op: &ModuleOperationIr) -> Result<()> {
        match op {
            ModuleOperationIr::Embedding(d) => {
                let weights = self.input(&d.weights)?;
                let indices = self.input(&d.indices)?;
                let indices = self.convert(&indices, ElementType::S64);
                let rank = indices.ty.rank();
                let width = weights.ty.dims[1];
                let mut dims = indices.ty.dims.clone();
                dims.push(width);
                let y = self.gather(
                    &weights,
                    &indices,
                    &[rank],
                    &[0],
                    &[0],
                    rank,
                    &[1, width],
                    dims,
                );
                self.bind(&d.out, y)
            }
            ModuleOperationIr::Linear(d) => {
                let x = self.input(&d.x)?;
                let w = self.input(&d.weight)?;
                let rank = x.ty.rank();
                let mut dims = x.ty.dims.clone();
                let outputs = w.ty.dims[1];
                dims[rank - 1] = outputs;
                let (mut y, bias) = if self.host_matmul_takes(&x.ty, &w.ty) {
                    let host_bias = self.host_bias(d.bias.as_ref(), outputs)?;
                    let y = self.host_matmul(&x, &w, host_bias.as_ref());
                    (y, d.bias.as_ref().filter(|_| host_bias.is_none()))
                } else {
                    let y = self.dot_general(&x, &w, (&[], &[]), (&[rank - 1], &[0]), dims.clone());
                    (y, d.bias.as_ref())
                };
                if let Some(bias) = bias {
                    let b = self.input(bias)?;
                    let b = self.broadcast_in_dim(&b, &dims, &[rank - 1]);
                    y = self.binary("stablehlo.add", &y, &b);
                }
                self.bind(&d.out, y)
            }
            ModuleOperationIr::Conv1d(d) => self.convolution(
                &d.x,
                &d.weight,
                d.bias.as_ref(),
                &d.options.stride,
                &d.options.padding,
                &d.options.dilation,
                d.options.groups,
                &d.out,
            ),
            ModuleOperationIr::Conv2d(d) => self.convolution(
                &d.x,
                &d.weight,
                d.bias.as_ref(),
                &d.options.stride,
                &d.options.padding,
                &d.options.dilation,
                d.options.groups,
                &d.out,
            ),
            ModuleOperationIr::Conv3d(d) => self.convolution(
                &d.x,
                &d.weight,
                d.bias.as_ref(),
                &d.options.stride,
                &d.options.padding,
                &d.options.dilation,
                d.options.groups,
                &d.out,
            ),
            ModuleOperationIr::ConvTranspose1d(d) => self.conv_transpose(
                &d.x,
                &d.weight,
                d.bias.as_ref(),
                &d.options.stride,
                &d.options.padding,
                &d.options.padding_out,
                &d.options.dilation,
                d.options.groups,
                &d.out,
            ),
            ModuleOperationIr::ConvTranspose2d(d) => self.conv_transpose(
                &d.x,
                &d.weight,
                d.bias.as_ref(),
                &d.options.stride,
                &d.options.padding,
                &d.options.padding_out,
                &d.options.dilation,
                d.options.groups,
                &d.out,
            ),
            ModuleOperationIr::ConvTranspose3d(d) => self.conv_transpose(
                &d.x,
                &d.weight,
                d.bias.as_ref(),
                &d.options.stride,
                &d.options.padding,
                &d.options.padding_out,
                &d.options.dilation,
                d.options.groups,
                &d.out,
            ),
            ModuleOperationIr::Interpolate(d) if d.options.mode == InterpolateModeIr::Bilinear => {
                let x = self.input(&d.x)?;
                let elem = x.ty.elem;
                let mut y = if is_float(elem) && elem != ElementType::F64 {
                    self.convert(&x, ElementType::F32)
                } else {
                    x.clone()
                };
                for (axis, &out_size) in [2usize, 3].iter().zip(&d.output_size) {
                    let in_size = x.ty.dims[*axis];
                    y = self.linear_resize(&y, *axis, in_size, out_size, d.options.align_corners);
                }
                let y = self.convert(&y, elem);
                self.bind(&d.out, y)
            }
            ModuleOperationIr::Interpolate(d) => {
                if d.options.mode != InterpolateModeIr::Nearest {
                    return self.unsupported(&format!(
                        "interpolation mode {:?}; nearest and bilinear are lowered",
                        d.options.mode
                    ));
                }
                let x = self.input(&d.x)?;
                let mut y = x.clone();
                for (axis, &out_size) in [2usize, 3].iter().zip(&d.output_size) {
                    let in_size = x.ty.dims[*axis];
                    if in_size == out_size {
                        continue;
                    }
                    // floor(o * in / out), exactly, in integers.
                    let o = self.iota(&[out_size], 0, ElementType::S64);
                    let scale = self.filled(in_size as f64, &o.ty);
                    let scaled = self.binary("stablehlo.multiply", &o, &scale);
                    let divisor = self.filled(out_size as f64, &o.ty);
                    let index = self.binary("stablehlo.divide", &scaled, &divisor);
                    y = self.take(&y, *axis, &index);
                }
                self.bind(&d.out, y)
            }
            ModuleOperationIr::Attention(d) => self.attention(d),
            ModuleOperationIr::AvgPool2d(d) => {
                if d.ceil_mode {
                    return self.unsupported("ceil_mode");
                }
                let x = self.input(&d.x)?;
                let window = [1, 1, d.kernel_size[0], d.kernel_size[1]];
                let strides = [1, 1, d.stride[0], d.stride[1]];
                let padding = [
                    (0, 0),
                    (0, 0),
                    (d.padding[0], d.padding[0]),
                    (d.padding[1], d.padding[1]),
                ];
                let wide = self.convert(
                    &x,
                    if is_float(x.ty.elem) && x.ty.elem != ElementType::F64 {
                        ElementType::F32
                    } else {
                        x.ty.elem
                    },
                );
                let sum =
                    self.reduce_window(&wide, &window, &strides, &padding, "stablehlo.add", 0.0);
                let count = if d.count_include_pad || (d.padding == [0, 0]) {
                    let n = (d.kernel_size[0] * d.kernel_size[1]) as f64;
                    self.filled(n, &sum.ty)
                } else {
                    let ones = self.filled(1.0, &wide.ty);
                    self.reduce_window(&ones, &window, &strides, &padding, "stablehlo.add", 0.0)
                };
                let y = self.binary("stablehlo.divide", &sum, &count);
                let y = self.convert(&y, x.ty.elem);
                self.bind(&d.out, y)
            }
            ModuleOperationIr::MaxPool2d(d) => {
                if d.ceil_mode || d.dilation != [1, 1] {
                    return self.unsupported("ceil_mode or dilation");
                }
                let x = self.input(&d.x)?;
                let window = [1, 1, d.kernel_size[0], d.kernel_size[1]];
                let strides = [1, 1, d.stride[0], d.stride[1]];
                let padding = [
                    (0, 0),
                    (0, 0),
                    (d.padding[0], d.padding[0]),
                    (d.padding[1], d.padding[1]),
                ];
                let y = self.reduce_window(
                    &x,
                    &window,
                    &strides,
                    &padding,
                    "stablehlo.maximum",
                    lowest(x.ty.elem),
                );
                self.bind(&d.out, y)
            }
            _ => self.unsupported(""),
        }
    }

    /// N-d convolution, NC(spatial) input and OI(spatial) kernel, plus bias.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn convolution(
        &mut self,
        x: &TensorIr,
        weight: &TensorIr,
        bias: Option<&TensorIr>,
        stride: &[usize],
        padding: &[usize],
        dilation: &[usize],
        groups: usize,
        out: &TensorIr,
    ) -> Result<()> {
        let x = self.input(x)?;
        if self.host_convolution(&x, weight, stride, padding, dilation, groups) {
            let w = self.input(weight)?;
            let b = self.host_bias(bias, w.ty.dims[0])?;
            let operands = [Some(&x), Some(&w), b.as_ref()].into_iter().flatten();
            let ty = x.ty.with_dims(out.shape.to_vec());
            let config = format!(
                "backend_config = {{padding = {} : i64, stride = {} : i64}}",
                padding[0], stride[0]
            );
            let y = self.host_call(crate::host_kernels::CONV2D_F32, operands, &config, ty);
            return self.bind_with_bias(y, bias.filter(|_| b.is_none()), out);
        }
        let spatial = (0..stride.len()).map(|i| i.to_string()).collect::<Vec<_>>();
        let layout = |a: &str, b: &str| format!("[{a}, {b}, {}]", spatial.join(", "));
        // A weight argument, spatial dimensions first (`with_kernels_last`).
        let kernels_last = self.kernels_last && groups == 1 && !self.has_value(weight.id);
        let (w, kernel_layout) = if kernels_last {
            let rank = weight.shape.len();
            let permutation = (2..rank).chain([1, 0]).collect::<Vec<_>>();
            let w = self.permuted_input(weight, &permutation)?;
            (w, format!("[{}, i, o]", spatial.join(", ")))
        } else {
            (self.input(weight)?, layout("o", "i"))
        };
        let w = self.convert(&w, x.ty.elem);
        let dims = out.shape.to_vec();
        let ty = x.ty.with_dims(dims.clone());
        let precision = if matches!(x.ty.elem, ElementType::F32 | ElementType::F64) {
            ", precision_config = [#stablehlo<precision HIGHEST>, #stablehlo<precision HIGHEST>]"
        } else {
            ""
        };
        let result = self.fresh();
        let _ = writeln!(
            self.body,
            "    {result} = stablehlo.convolution({}, {}) dim_numbers = {}x{}->{}, window = {{stride = {}, pad = [{}], rhs_dilate = {}}} {{batch_group_count = 1 : i64, feature_group_count = {groups} : i64{precision}}} : ({}, {}) -> {}",
            x.name,
            w.name,
            layout("b", "f"),
            kernel_layout,
            layout("b", "f"),
            list(stride),
            padding.iter().map(|p| format!("[{p}, {p}]")).collect::<Vec<_>>().join(", "),
            list(dilation),
            x.ty.mlir(),
            w.ty.mlir(),
            ty.mlir()
        );
        self.bind_with_bias(Value { name: result, ty }, bias, out)
    }

    /// Binds `out` to the convolution result `y` plus `bias` (per channel, dimension 1).
    fn bind_with_bias(
        &mut self,
        mut y: Value,
        bias: Option<&TensorIr>,
        out: &TensorIr,
    ) -> Result<()> {
        if let Some(bias) = bias {
            let b = self.input(bias)?;
            let b = self.convert(&b, y.ty.elem);
            let b = self.broadcast_in_dim(&b, &y.ty.dims.clone(), &[1]);
            y = self.binary("stablehlo.add", &y, &b);
        }
        self.bind(out, y)
    }

    /// `bias` as the f32 `[len]` operand of a host kernel, which adds it to its output; `None`
    /// when there is no bias or it is not that (the caller adds it after the call).
    fn host_bias(&mut self, bias: Option<&TensorIr>, len: usize) -> Result<Option<Value>> {
        match bias {
            Some(b)
                if super::element_type(b.dtype) == Some(ElementType::F32)
                    && b.shape.to_vec() == [len] =>
            {
                self.input(b).map(Some)
            }
            _ => Ok(None),
        }
    }

    /// `stablehlo.custom_call @target(operands)` of a host kernel with one result of type `ty`
    /// and the attributes `config` (empty, or `backend_config = {...}`).
    fn host_call<'v>(
        &mut self,
        target: &str,
        operands: impl Iterator<Item = &'v Value>,
        config: &str,
        ty: TensorType,
    ) -> Value {
        let operands: Vec<&Value> = operands.collect();
        let names = operands.iter().map(|v| v.name.as_str()).collect::<Vec<_>>();
        let types = operands.iter().map(|v| v.ty.mlir()).collect::<Vec<_>>();
        let config = if config.is_empty() {
            String::new()
        } else {
            format!(", {config}")
        };
        let result = self.fresh();
        let _ = writeln!(
            self.body,
            "    {result} = stablehlo.custom_call @{target}({}) {{api_version = 4 : i32{config}}} : ({}) -> {}",
            names.join(", "),
            types.join(", "),
            ty.mlir()
        );
        Value { name: result, ty }
    }

    /// Whether this convolution goes to the host kernel [`crate::host_kernels::CONV2D_F32`]
    /// ([`Lowerer::with_host_kernels`]): 2-D, f32 input and kernel, a square kernel, the same
    /// stride and padding in both dimensions, dilation 1, one group.
    fn host_convolution(
        &self,
        x: &Value,
        weight: &TensorIr,
        stride: &[usize],
        padding: &[usize],
        dilation: &[usize],
        groups: usize,
    ) -> bool {
        let w = &weight.shape;
        self.host_kernel(crate::host_kernels::CONV2D_F32)
            && stride.len() == 2
            && x.ty.elem == ElementType::F32
            && super::element_type(weight.dtype) == Some(ElementType::F32)
            && w.len() == 4
            && w[2] == w[3]
            && w[1] == x.ty.dims[1]
            && stride[0] == stride[1]
            && stride[0] > 0
            && padding[0] == padding[1]
            && dilation.iter().all(|&d| d == 1)
            && groups == 1
            && x.ty.dims[2] + 2 * padding[0] >= w[2]
            && x.ty.dims[3] + 2 * padding[0] >= w[3]
    }

    /// Transposed convolution as a convolution of the input dilated by the
    /// stride, with the kernel flipped and its in/out features swapped per
    /// group. Burn's kernel is `[in, out / groups, k...]`.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn conv_transpose(
        &mut self,
        x: &TensorIr,
        weight: &TensorIr,
        bias: Option<&TensorIr>,
        stride: &[usize],
        padding: &[usize],
        padding_out: &[usize],
        dilation: &[usize],
        groups: usize,
        out: &TensorIr,
    ) -> Result<()> {
        let x = self.input(x)?;
        let w = self.input(weight)?;
        let w = self.convert(&w, x.ty.elem);
        let spatial_rank = stride.len();
        let (c_in, c_out_g) = (w.ty.dims[0], w.ty.dims[1]);
        let kernel = w.ty.dims[2..].to_vec();
        if groups == 0 || c_in % groups != 0 {
            return self.internal("groups must divide the input channels");
        }
        // [in, out/g, k] -> [g, in/g, out/g, k] -> [g, out/g, in/g, k] -> [out, in/g, k]
        let grouped = [&[groups, c_in / groups, c_out_g][..], &kernel].concat();
        let w = self.reshape(&w, &grouped);
        let mut permutation = vec![0, 2, 1];
        permutation.extend(3..3 + spatial_rank);
        let w = self.transpose(&w, &permutation);
        let oi = [&[groups * c_out_g, c_in / groups][..], &kernel].concat();
        let w = self.reshape(&w, &oi);
        let flip = (2..2 + spatial_rank).collect::<Vec<_>>();
        let w_ty = w.ty.clone();
        let w = self.emit(
            "stablehlo.reverse",
            &[&w],
            &format!("dimensions = {}", i64_array(&flip)),
            w_ty,
        );
        let pads = (0..spatial_rank)
            .map(|i| {
                let reach = (dilation[i] * (kernel[i] - 1)) as i64;
                let low = reach - padding[i] as i64;
                (low, low + padding_out[i] as i64)
            })
            .collect::<Vec<_>>();
        let spatial = (0..spatial_rank).map(|i| i.to_string()).collect::<Vec<_>>();
        let layout = |a: &str, b: &str| format!("[{a}, {b}, {}]", spatial.join(", "));
        let dims = out.shape.to_vec();
        let ty = x.ty.with_dims(dims.clone());
        let precision = if matches!(x.ty.elem, ElementType::F32 | ElementType::F64) {
            ", precision_config = [#stablehlo<precision HIGHEST>, #stablehlo<precision HIGHEST>]"
        } else {
            ""
        };
        let result = self.fresh();
        let _ = writeln!(
            self.body,
            "    {result} = stablehlo.convolution({}, {}) dim_numbers = {}x{}->{}, window = {{stride = {}, pad = [{}], lhs_dilate = {}, rhs_dilate = {}}} {{batch_group_count = 1 : i64, feature_group_count = {groups} : i64{precision}}} : ({}, {}) -> {}",
            x.name,
            w.name,
            layout("b", "f"),
            layout("o", "i"),
            layout("b", "f"),
            list(&vec![1; spatial_rank]),
            pads.iter().map(|(lo, hi)| format!("[{lo}, {hi}]")).collect::<Vec<_>>().join(", "),
            list(stride),
            list(dilation),
            x.ty.mlir(),
            w.ty.mlir(),
            ty.mlir()
        );
        let mut y = Value { name: result, ty };
        if let Some(bias) = bias {
            let b = self.input(bias)?;
            let b = self.convert(&b, y.ty.elem);
            let b = self.broadcast_in_dim(&b, &dims, &[1]);
            y = self.binary("stablehlo.add", &y, &b);
        }
        self.bind(out, y)
    }

    /// A rank-1 constant, fixed by the op's structure.
    pub(super) fn dense(&mut self, values: &[f64], elem: ElementType) -> Value {
        let ty = TensorType::new(vec![values.len()], elem);
        let items = values
            .iter()
            .map(|&v| match elem {
                ElementType::S64 => format!("{}", v as i64),
                _ => format!("{:.9e}", v),
            })
            .collect::<Vec<_>>()
            .join(", ");
        self.emit(
            "stablehlo.constant",
            &[],
            &format!("value = dense<[{items}]> : {}", ty.mlir()),
            ty,
        )
    }

    /// Linear interpolation along `axis` as Burn's CPU backend does it:
    /// `x[lo] * (1 - w) + x[hi] * w`, the coordinates from the sizes.
    pub(super) fn linear_resize(
        &mut self,
        x: &Value,
        axis: usize,
        in_size: usize,
        out_size: usize,
        align_corners: bool,
    ) -> Value {
        let ratio = if align_corners {
            (in_size as f64 - 1.0) / (out_size.max(1) - 1).max(1) as f64
        } else {
            in_size as f64 / out_size as f64
        };
        let mut low = Vec::with_capacity(out_size);
        let mut high = Vec::with_capacity(out_size);
        let mut weight = Vec::with_capacity(out_size);
        for o in 0..out_size {
            let coord = if align_corners {
                o as f64 * ratio
            } else {
                (o as f64 + 0.5) * ratio - 0.5
            };
            let lo = coord.floor().max(0.0) as usize;
            low.push(lo as f64);
            high.push(((lo + 1).min(in_size - 1)) as f64);
            weight.push((coord - lo as f64).max(0.0));
        }
        let low = self.dense(&low, ElementType::S64);
        let high = self.dense(&high, ElementType::S64);
        let w = self.dense(&weight, x.ty.elem);
        let a = self.take(x, axis, &low);
        let b = self.take(x, axis, &high);
        let dims = a.ty.dims.clone();
        let w = self.broadcast_in_dim(&w, &dims, &[axis]);
        let one = self.filled(1.0, &w.ty);
        let w_low = self.binary("stablehlo.subtract", &one, &w);
        let a = self.binary("stablehlo.multiply", &a, &w_low);
        let b = self.binary("stablehlo.multiply", &b, &w);
        self.binary("stablehlo.add", &a, &b)
    }

    /// softmax(scale * q k^T [softcap] [mask] [causal] [+ bias]) v, the
    /// softmax in f32 for half types, fully masked rows giving zeros like
    /// Burn's reference.
    pub(super) fn attention(&mut self, d: &AttentionOpIr) -> Result<()> {
        let q = self.input(&d.query)?;
        let k = self.input(&d.key)?;
        let v = self.input(&d.value)?;
        let elem = q.ty.elem;
        if q.ty.rank() != 4 || k.ty.rank() != 4 || v.ty.rank() != 4 {
            return self.unsupported("attention on tensors that are not [batch, heads, seq, dim]");
        }
        if let Some(y) = self.kernel_attention(d, &q, &k, &v)? {
            return self.bind(&d.out, y);
        }
        if let Some(y) = self.host_attention(d, &q, &k, &v) {
            return self.bind(&d.out, y);
        }
        let (b, h, lq, dk) = (q.ty.dims[0], q.ty.dims[1], q.ty.dims[2], q.ty.dims[3]);
        let lk = k.ty.dims[2];
        let dv = v.ty.dims[3];
        let scores = self.dot_general(&q, &k, (&[0, 1], &[0, 1]), (&[3], &[3]), vec![b, h, lq, lk]);
        let compute = if matches!(elem, ElementType::F16 | ElementType::BF16) {
            ElementType::F32
        } else {
            elem
        };
        let mut s = self.convert(&scores, compute);
        let scale = match d.options.scale {
            Some(scale) => scale,
            None => ScalarIr::Float(1.0 / (dk as f64).sqrt()),
        };
        let scale = self.scalar(scale, compute);
        let scale = self.broadcast(&scale, &s.ty.dims);
        s = self.binary("stablehlo.multiply", &s, &scale);
        if let Some(cap) = d.options.softcap {
            let cap = self.scalar(cap, compute);
            let cap = self.broadcast(&cap, &s.ty.dims);
            let scaled = self.binary("stablehlo.divide", &s, &cap);
            let t = self.unary("stablehlo.tanh", &scaled);
            s = self.binary("stablehlo.multiply", &t, &cap);
        }
        let dims = s.ty.dims.clone();
        let neg_inf = self.filled(f64::NEG_INFINITY, &s.ty);
        if let Some(mask) = &d.mask {
            let m = self.input(mask)?;
            let m = self.broadcast(&m, &dims);
            s = self.select(&m, &neg_inf, &s);
        }
        if d.options.is_causal {
            // Bottom-right aligned like Burn's reference: key j is in the
            // future of query i when j > i + (lk - lq).
            let mut row = self.iota(&dims, 2, ElementType::S64);
            if lk != lq {
                let offset = self.filled(lk as f64 - lq as f64, &row.ty);
                row = self.binary("stablehlo.add", &row, &offset);
            }
            let col = self.iota(&dims, 3, ElementType::S64);
            let future = self.compare("GT", &col, &row);
            s = self.select(&future, &neg_inf, &s);
        }
        if let Some(bias) = &d.attn_bias {
            let bias = self.input(bias)?;
            let bias = self.broadcast(&bias, &dims);
            let bias = self.convert(&bias, compute);
            s = self.binary("stablehlo.add", &s, &bias);
        }
        let max = self.reduce(&s, &[3], "stablehlo.maximum", f64::NEG_INFINITY);
        let floor = self.filled(lowest_finite(compute), &max.ty);
        let max = self.binary("stablehlo.maximum", &max, &floor);
        let max = self.broadcast_in_dim(&max, &dims, &[0, 1, 2]);
        let shifted = self.binary("stablehlo.subtract", &s, &max);
        let e = self.unary("stablehlo.exponential", &shifted);
        let sum = self.reduce(&e, &[3], "stablehlo.add", 0.0);
        let tiny = self.filled(min_positive(compute), &sum.ty);
        let sum = self.binary("stablehlo.maximum", &sum, &tiny);
        let sum = self.broadcast_in_dim(&sum, &dims, &[0, 1, 2]);
        let p = self.binary("stablehlo.divide", &e, &sum);
        let p = self.convert(&p, v.ty.elem);
        let y = self.dot_general(&p, &v, (&[0, 1], &[0, 1]), (&[3], &[2]), vec![b, h, lq, dv]);
        self.bind(&d.out, y)
    }

    /// Attention as a call of the host kernel [`crate::host_kernels::ATTENTION_F32`]
    /// ([`Lowerer::with_host_kernels`]), which takes `[batch, seq, heads, head_dim]`: f32,
    /// one shape for keys and values, no mask, bias or softcap, the default scale, causal only
    /// over as many keys as queries; `None` (the plain lowering) otherwise. The transposes
    /// around the call undo the model's own, and XLA folds the pairs away.
    fn host_attention(
        &mut self,
        d: &AttentionOpIr,
        q: &Value,
        k: &Value,
        v: &Value,
    ) -> Option<Value> {
        let (b, h, lq, dk) = (q.ty.dims[0], q.ty.dims[1], q.ty.dims[2], q.ty.dims[3]);
        let default_scale = 1.0 / (dk as f64).sqrt();
        let scale_ok = match d.options.scale {
            None => true,
            Some(ScalarIr::Float(scale)) => (scale - default_scale).abs() <= 1e-12 * default_scale,
            Some(_) => false,
        };
        let takes = self.host_kernel(crate::host_kernels::ATTENTION_F32)
            && scale_ok
            && d.mask.is_none()
            && d.attn_bias.is_none()
            && d.options.softcap.is_none()
            && [&q.ty, &k.ty, &v.ty]
                .iter()
                .all(|t| t.elem == ElementType::F32)
            && k.ty == v.ty
            && k.ty.dims[0] == b
            && k.ty.dims[1] == h
            && k.ty.dims[3] == dk
            && k.ty.dims[2] > 0
            && (!d.options.is_causal || k.ty.dims[2] == lq);
        if !takes {
            return None;
        }
        let swap = [0, 2, 1, 3];
        let (qt, kt, vt) = (
            self.transpose(q, &swap),
            self.transpose(k, &swap),
            self.transpose(v, &swap),
        );
        let config = format!(
            "backend_config = {{causal = {} : i64}}",
            i64::from(d.options.is_causal)
        );
        let ty = qt.ty.clone();
        let operands = [&qt, &kt, &vt].into_iter();
        let y = self.host_call(crate::host_kernels::ATTENTION_F32, operands, &config, ty);
        Some(self.transpose(&y, &swap))
    }

    /// Attention as a call of the hub's flash attention kernel ([`Lowerer::with_kernels`]):
    /// only plain softmax attention (no mask, bias, softcap or causality) whose q, k and v
    /// share one shape and dtype, f32 or bf16, and whose scale is the kernel's; `None` (the
    /// plain lowering) otherwise or when the hub has no such kernel.
    fn kernel_attention(
        &mut self,
        d: &AttentionOpIr,
        q: &Value,
        k: &Value,
        v: &Value,
    ) -> Result<Option<Value>> {
        let Some(kernels) = self.kernels.clone() else {
            return Ok(None);
        };
        let plain = d.mask.is_none()
            && d.attn_bias.is_none()
            && d.options.softcap.is_none()
            && !d.options.is_causal;
        let dtype = match q.ty.elem {
            ElementType::F32 => "float32",
            ElementType::BF16 => "bfloat16",
            _ => return Ok(None),
        };
        if !plain || q.ty != k.ty || q.ty != v.ty || q.ty.rank() != 4 {
            return Ok(None);
        }
        let scale = match d.options.scale {
            Some(ScalarIr::Float(scale)) => scale,
            Some(_) => return Ok(None),
            None => 1.0 / (q.ty.dims[3] as f64).sqrt(),
        };
        // Per device: the batch over the data-parallel axis, the heads over the tensor-parallel one.
        let mut local = q.ty.clone();
        if let Some(mesh) = self.kernel_mesh {
            if !local.dims[0].is_multiple_of(mesh.dp) || !local.dims[1].is_multiple_of(mesh.tp) {
                return Ok(None);
            }
            local.dims[0] /= mesh.dp;
            local.dims[1] /= mesh.tp;
        }
        let Some(kernel) = kernels.flash_attention(&local.dims, dtype, scale) else {
            return Ok(None);
        };
        let entry = match self
            .spliced
            .iter()
            .find(|(file, _, _)| *file == kernel.file)
        {
            Some((_, entry, _)) => entry.clone(),
            None => {
                let prefix = format!("oxidiff_kernel{}_", self.spliced.len());
                let (functions, entry) =
                    match crate::kernels::inline_functions(&kernel.mlir, &prefix) {
                        Ok(inlined) => inlined,
                        Err(reason) => {
                            kernels.log_once(&format!(
                                "kernel artifact {} is damaged ({reason}): export it again \
                                 with tools/kernels/",
                                kernel.file.display()
                            ));
                            return Ok(None);
                        }
                    };
                self.spliced
                    .push((kernel.file.clone(), entry.clone(), functions));
                entry
            }
        };
        self.kernel_calls += 1;
        let callee = format!("callee = @{entry}");
        let Some(mesh) = self.kernel_mesh else {
            return Ok(Some(self.emit(
                "func.call",
                &[q, k, v],
                &callee,
                q.ty.clone(),
            )));
        };
        // Tiles [dp, tp, 1, 1] over the partitions in order (partition p is data-parallel
        // block p / tp and tensor-parallel block p % tp, as `spmd::Layout` numbers them).
        let devices: Vec<String> = (0..mesh.partitions()).map(|p| p.to_string()).collect();
        let tiled = format!(
            "{{devices=[{},{},1,1]{}}}",
            mesh.dp,
            mesh.tp,
            devices.join(",")
        );
        let sharding = |sharding: &str| format!("mhlo.sharding = \"{sharding}\"");
        let custom_call = |target: &str, sharding_attr: &str| {
            format!("call_target_name = \"{target}\", {sharding_attr}")
        };
        let to_local = |lowerer: &mut Self, x: &Value| {
            let full = lowerer.emit(
                "stablehlo.custom_call",
                &[x],
                &custom_call("Sharding", &sharding(&tiled)),
                x.ty.clone(),
            );
            lowerer.emit(
                "stablehlo.custom_call",
                &[&full],
                &custom_call("SPMDFullToShardShape", &sharding("{manual}")),
                local.clone(),
            )
        };
        let (q, k, v) = (to_local(self, q), to_local(self, k), to_local(self, v));
        let y = self.emit("func.call", &[&q, &k, &v], &callee, local.clone());
        let y = self.emit(
            "stablehlo.custom_call",
            &[&y],
            &custom_call("Sharding", &sharding("{manual}")),
            local.clone(),
        );
        Ok(Some(self.emit(
            "stablehlo.custom_call",
            &[&y],
            &custom_call("SPMDShardToFullShape", &sharding(&tiled)),
            whole_block(&local, mesh),
        )))
    }
}

/// The whole tensor of a per-device attention block `local` on `mesh` (batch times the
/// data-parallel degree, heads times the tensor-parallel one).
fn whole_block(local: &TensorType, mesh: crate::spmd::Mesh) -> TensorType {
    let mut full = local.clone();
    full.dims[0] *= mesh.dp;
    full.dims[1] *= mesh.tp;
    full
}
