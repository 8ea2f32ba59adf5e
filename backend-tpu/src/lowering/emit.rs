//! Emitting StableHLO: the function's values (arguments, scalars, bindings)
//! and one helper per StableHLO op the op families build on.

use std::fmt::Write as _;

use burn_ir::{ScalarIr, TensorIr};

use super::{is_unsigned, Argument, Lowerer, Result, TensorType, Value};
use crate::pjrt::ElementType;

impl Lowerer {
    pub(super) fn fresh(&mut self) -> String {
        self.counter += 1;
        format!("%v{}", self.counter)
    }

    /// The value of an input tensor: computed earlier in this function, or a
    /// new argument.
    pub(super) fn input(&mut self, tensor: &TensorIr) -> Result<Value> {
        if let Some(value) = self.values.get(&tensor.id) {
            return Ok(value.clone());
        }
        let ty = self.ty(tensor)?;
        let value = Value {
            name: format!("%arg{}", self.arguments.len()),
            ty: ty.clone(),
        };
        self.arguments.push((Argument::Tensor(tensor.id), ty));
        self.values.insert(tensor.id, value.clone());
        Ok(value)
    }

    /// `tensor` as an [`Argument::Permuted`] by `permutation` (declared once
    /// per tensor).
    pub(super) fn permuted_input(
        &mut self,
        tensor: &TensorIr,
        permutation: &[usize],
    ) -> Result<Value> {
        if let Some(value) = self.permuted.get(&tensor.id) {
            return Ok(value.clone());
        }
        let ty = self.ty(tensor)?;
        let ty = ty.with_dims(permutation.iter().map(|&p| ty.dims[p]).collect::<Vec<_>>());
        let value = Value {
            name: format!("%arg{}", self.arguments.len()),
            ty: ty.clone(),
        };
        self.arguments.push((
            Argument::Permuted {
                id: tensor.id,
                permutation: permutation.to_vec(),
            },
            ty,
        ));
        self.permuted.insert(tensor.id, value.clone());
        Ok(value)
    }

    /// A scalar of the op as a rank-0 argument of element type `elem`.
    pub(super) fn scalar(&mut self, scalar: ScalarIr, elem: ElementType) -> Value {
        let ty = TensorType::new(Vec::new(), elem);
        let value = Value {
            name: format!("%arg{}", self.arguments.len()),
            ty: ty.clone(),
        };
        self.arguments.push((Argument::Scalar(scalar), ty));
        value
    }

    /// Binds `out` to `value`, converting a mismatch in the element type and
    /// reshaping one in dimensions with the same element count.
    pub(super) fn bind(&mut self, out: &TensorIr, value: Value) -> Result<()> {
        let ty = self.ty(out)?;
        let mut value = value;
        if value.ty.elem != ty.elem {
            value = self.convert(&value, ty.elem);
        }
        if value.ty.dims != ty.dims {
            let have: usize = value.ty.dims.iter().product();
            let want: usize = ty.dims.iter().product();
            if have != want {
                return self.internal(format!(
                    "computed {:?} for output {:?}",
                    value.ty.dims, ty.dims
                ));
            }
            value = self.reshape(&value, &ty.dims);
        }
        self.values.insert(out.id, value);
        Ok(())
    }

    /// `%r = "name"(operands) attrs : (types) -> ty`.
    pub(super) fn emit(
        &mut self,
        name: &str,
        operands: &[&Value],
        attrs: &str,
        ty: TensorType,
    ) -> Value {
        let result = self.fresh();
        let names = operands
            .iter()
            .map(|v| v.name.as_str())
            .collect::<Vec<_>>()
            .join(", ");
        let types = operands
            .iter()
            .map(|v| v.ty.mlir())
            .collect::<Vec<_>>()
            .join(", ");
        let attrs = if attrs.is_empty() {
            String::new()
        } else {
            format!(" {{{attrs}}}")
        };
        let _ = writeln!(
            self.body,
            "    {result} = \"{name}\"({names}){attrs} : ({types}) -> {}",
            ty.mlir()
        );
        Value { name: result, ty }
    }

    /// A rank-0 constant fixed by the op's structure.
    pub(super) fn constant(&mut self, value: f64, elem: ElementType) -> Value {
        let ty = TensorType::new(Vec::new(), elem);
        let literal = literal(value, elem);
        self.emit(
            "stablehlo.constant",
            &[],
            &format!("value = dense<{literal}> : {}", ty.mlir()),
            ty,
        )
    }

    /// A constant of `dims` filled with `value`.
    pub(super) fn filled(&mut self, value: f64, ty: &TensorType) -> Value {
        let scalar = self.constant(value, ty.elem);
        self.broadcast(&scalar, &ty.dims)
    }

    pub(super) fn unary(&mut self, name: &str, x: &Value) -> Value {
        let ty = x.ty.clone();
        self.emit(name, &[x], "", ty)
    }

    pub(super) fn binary(&mut self, name: &str, a: &Value, b: &Value) -> Value {
        let ty = a.ty.clone();
        self.emit(name, &[a, b], "", ty)
    }

    /// Numpy broadcasting (trailing dimensions aligned) to `dims`.
    pub(super) fn broadcast(&mut self, x: &Value, dims: &[usize]) -> Value {
        if x.ty.dims == dims {
            return x.clone();
        }
        let offset = dims.len().saturating_sub(x.ty.rank());
        let mapping = (offset..dims.len()).collect::<Vec<_>>();
        let ty = x.ty.with_dims(dims);
        self.emit(
            "stablehlo.broadcast_in_dim",
            &[x],
            &format!("broadcast_dimensions = {}", i64_array(&mapping)),
            ty,
        )
    }

    /// Broadcast with an explicit mapping of `x`'s dimensions.
    pub(super) fn broadcast_in_dim(
        &mut self,
        x: &Value,
        dims: &[usize],
        mapping: &[usize],
    ) -> Value {
        let ty = x.ty.with_dims(dims);
        self.emit(
            "stablehlo.broadcast_in_dim",
            &[x],
            &format!("broadcast_dimensions = {}", i64_array(mapping)),
            ty,
        )
    }

    pub(super) fn reshape(&mut self, x: &Value, dims: &[usize]) -> Value {
        if x.ty.dims == dims {
            return x.clone();
        }
        let ty = x.ty.with_dims(dims);
        self.emit("stablehlo.reshape", &[x], "", ty)
    }

    pub(super) fn transpose(&mut self, x: &Value, permutation: &[usize]) -> Value {
        if permutation.iter().enumerate().all(|(i, &p)| i == p) {
            return x.clone();
        }
        let dims = permutation
            .iter()
            .map(|&p| x.ty.dims[p])
            .collect::<Vec<_>>();
        let ty = x.ty.with_dims(dims);
        self.emit(
            "stablehlo.transpose",
            &[x],
            &format!("permutation = {}", i64_array(permutation)),
            ty,
        )
    }

    pub(super) fn convert(&mut self, x: &Value, elem: ElementType) -> Value {
        if x.ty.elem == elem {
            return x.clone();
        }
        if elem == ElementType::Pred {
            // x != 0, the cast every frontend means.
            let zero = self.filled(0.0, &x.ty);
            return self.compare("NE", x, &zero);
        }
        let ty = x.ty.with_elem(elem);
        self.emit("stablehlo.convert", &[x], "", ty)
    }

    pub(super) fn compare(&mut self, direction: &str, a: &Value, b: &Value) -> Value {
        let ty = a.ty.with_elem(ElementType::Pred);
        self.emit(
            "stablehlo.compare",
            &[a, b],
            &format!("comparison_direction = #stablehlo<comparison_direction {direction}>"),
            ty,
        )
    }

    pub(super) fn select(&mut self, pred: &Value, on_true: &Value, on_false: &Value) -> Value {
        let ty = on_true.ty.clone();
        self.emit("stablehlo.select", &[pred, on_true, on_false], "", ty)
    }

    pub(super) fn iota(&mut self, dims: &[usize], dimension: usize, elem: ElementType) -> Value {
        self.emit(
            "stablehlo.iota",
            &[],
            &format!("iota_dimension = {dimension} : i64"),
            TensorType::new(dims, elem),
        )
    }

    pub(super) fn concatenate(&mut self, values: &[&Value], dimension: usize) -> Result<Value> {
        let Some(first) = values.first() else {
            return self.internal("concatenate of nothing");
        };
        if values.len() == 1 {
            return Ok((*first).clone());
        }
        let mut dims = first.ty.dims.clone();
        dims[dimension] = values.iter().map(|v| v.ty.dims[dimension]).sum();
        let ty = first.ty.with_dims(dims);
        Ok(self.emit(
            "stablehlo.concatenate",
            values,
            &format!("dimension = {dimension} : i64"),
            ty,
        ))
    }

    pub(super) fn slice(
        &mut self,
        x: &Value,
        start: &[usize],
        limit: &[usize],
        strides: &[usize],
    ) -> Value {
        let dims = start
            .iter()
            .zip(limit)
            .zip(strides)
            .map(|((&s, &l), &st)| if l > s { (l - s).div_ceil(st) } else { 0 })
            .collect::<Vec<_>>();
        let ty = x.ty.with_dims(dims);
        self.emit(
            "stablehlo.slice",
            &[x],
            &format!(
                "start_indices = {}, limit_indices = {}, strides = {}",
                i64_array(start),
                i64_array(limit),
                i64_array(strides)
            ),
            ty,
        )
    }

    /// `reduce` over `dimensions` with the binary `combiner` and `init`.
    pub(super) fn reduce(
        &mut self,
        x: &Value,
        dimensions: &[usize],
        combiner: &str,
        init: f64,
    ) -> Value {
        let init = self.constant(init, x.ty.elem);
        let dims =
            x.ty.dims
                .iter()
                .enumerate()
                .filter(|(i, _)| !dimensions.contains(i))
                .map(|(_, &d)| d)
                .collect::<Vec<_>>();
        let ty = x.ty.with_dims(dims);
        let scalar = TensorType::new(Vec::new(), x.ty.elem).mlir();
        let result = self.fresh();
        let a = self.fresh();
        let b = self.fresh();
        let c = self.fresh();
        let _ = writeln!(
            self.body,
            "    {result} = \"stablehlo.reduce\"({}, {}) ({{\n    ^bb0({a}: {scalar}, {b}: {scalar}):\n      {c} = \"{combiner}\"({a}, {b}) : ({scalar}, {scalar}) -> {scalar}\n      \"stablehlo.return\"({c}) : ({scalar}) -> ()\n    }}) {{dimensions = {}}} : ({}, {scalar}) -> {}",
            x.name,
            init.name,
            i64_array(dimensions),
            x.ty.mlir(),
            ty.mlir()
        );
        Value { name: result, ty }
    }

    /// `dot_general` with the given batch and contracting dimensions.
    pub(super) fn dot_general(
        &mut self,
        lhs: &Value,
        rhs: &Value,
        batch: (&[usize], &[usize]),
        contracting: (&[usize], &[usize]),
        dims: Vec<usize>,
    ) -> Value {
        let mut numbers = Vec::new();
        if !batch.0.is_empty() {
            numbers.push(format!("lhs_batching_dimensions = {}", list(batch.0)));
            numbers.push(format!("rhs_batching_dimensions = {}", list(batch.1)));
        }
        numbers.push(format!(
            "lhs_contracting_dimensions = {}",
            list(contracting.0)
        ));
        numbers.push(format!(
            "rhs_contracting_dimensions = {}",
            list(contracting.1)
        ));
        let mut attrs = format!(
            "dot_dimension_numbers = #stablehlo.dot<{}>",
            numbers.join(", ")
        );
        if lhs.ty.elem == ElementType::F32 || lhs.ty.elem == ElementType::F64 {
            // TPUs default to bf16 passes for f32 dots; ask for full precision.
            attrs.push_str(", precision_config = [#stablehlo<precision HIGHEST>, #stablehlo<precision HIGHEST>]");
        }
        let ty = lhs.ty.with_dims(dims);
        self.emit("stablehlo.dot_general", &[lhs, rhs], &attrs, ty)
    }

    /// `gather` with explicit dimension numbers.
    #[allow(clippy::too_many_arguments)]
    pub(super) fn gather(
        &mut self,
        operand: &Value,
        indices: &Value,
        offset_dims: &[usize],
        collapsed: &[usize],
        start_index_map: &[usize],
        index_vector_dim: usize,
        slice_sizes: &[usize],
        dims: Vec<usize>,
    ) -> Value {
        let mut numbers = Vec::new();
        if !offset_dims.is_empty() {
            numbers.push(format!("offset_dims = {}", list(offset_dims)));
        }
        if !collapsed.is_empty() {
            numbers.push(format!("collapsed_slice_dims = {}", list(collapsed)));
        }
        numbers.push(format!("start_index_map = {}", list(start_index_map)));
        numbers.push(format!("index_vector_dim = {index_vector_dim}"));
        let attrs = format!(
            "dimension_numbers = #stablehlo.gather<{}>, indices_are_sorted = false, slice_sizes = {}",
            numbers.join(", "),
            i64_array(slice_sizes)
        );
        let ty = operand.ty.with_dims(dims);
        self.emit("stablehlo.gather", &[operand, indices], &attrs, ty)
    }

    /// `x[..., indices, ...]` along `dim` with a rank-1 index tensor.
    pub(super) fn take(&mut self, x: &Value, dim: usize, indices: &Value) -> Value {
        let rank = x.ty.rank();
        let count = indices.ty.dims.first().copied().unwrap_or(1);
        let offset_dims = (0..rank).filter(|&d| d != dim).collect::<Vec<_>>();
        let mut slice_sizes = x.ty.dims.clone();
        slice_sizes[dim] = 1;
        let mut dims = x.ty.dims.clone();
        dims[dim] = count;
        self.gather(
            x,
            indices,
            &offset_dims,
            &[dim],
            &[dim],
            1,
            &slice_sizes,
            dims,
        )
    }

    /// `reduce_window` with a binary combiner.
    pub(super) fn reduce_window(
        &mut self,
        x: &Value,
        window: &[usize],
        strides: &[usize],
        padding: &[(usize, usize)],
        combiner: &str,
        init: f64,
    ) -> Value {
        let init = self.constant(init, x.ty.elem);
        let dims =
            x.ty.dims
                .iter()
                .enumerate()
                .map(|(i, &d)| {
                    let padded = d + padding[i].0 + padding[i].1;
                    if padded < window[i] {
                        0
                    } else {
                        (padded - window[i]) / strides[i] + 1
                    }
                })
                .collect::<Vec<_>>();
        let ty = x.ty.with_dims(dims);
        let scalar = TensorType::new(Vec::new(), x.ty.elem).mlir();
        let result = self.fresh();
        let a = self.fresh();
        let b = self.fresh();
        let c = self.fresh();
        let _ = writeln!(
            self.body,
            "    {result} = \"stablehlo.reduce_window\"({}, {}) ({{\n    ^bb0({a}: {scalar}, {b}: {scalar}):\n      {c} = \"{combiner}\"({a}, {b}) : ({scalar}, {scalar}) -> {scalar}\n      \"stablehlo.return\"({c}) : ({scalar}) -> ()\n    }}) {{padding = dense<[{}]> : tensor<{}x2xi64>, window_dimensions = {}, window_strides = {}}} : ({}, {scalar}) -> {}",
            x.name,
            init.name,
            padding.iter().map(|(lo, hi)| format!("[{lo}, {hi}]")).collect::<Vec<_>>().join(", "),
            padding.len(),
            i64_array(window),
            i64_array(strides),
            x.ty.mlir(),
            ty.mlir()
        );
        Value { name: result, ty }
    }
}

/// `array<i64: 1, 2>`.
pub(super) fn i64_array(values: &[usize]) -> String {
    if values.is_empty() {
        return "array<i64>".to_string();
    }
    format!("array<i64: {}>", join(values))
}

/// `[1, 2]`.
pub(super) fn list(values: &[usize]) -> String {
    format!("[{}]", join(values))
}

pub(super) fn join(values: &[usize]) -> String {
    values
        .iter()
        .map(|v| v.to_string())
        .collect::<Vec<_>>()
        .join(", ")
}

/// The MLIR literal of `value` as an `elem` (floats as exact bit patterns).
pub(super) fn literal(value: f64, elem: ElementType) -> String {
    match elem {
        ElementType::F32 => format!("0x{:08X}", (value as f32).to_bits()),
        ElementType::F64 => format!("0x{:016X}", value.to_bits()),
        ElementType::F16 => format!("0x{:04X}", half::f16::from_f64(value).to_bits()),
        ElementType::BF16 => format!("0x{:04X}", half::bf16::from_f64(value).to_bits()),
        ElementType::Pred => (value != 0.0).to_string(),
        ElementType::U8 | ElementType::U16 | ElementType::U32 | ElementType::U64 => {
            format!("{}", value.max(0.0) as u64)
        }
        _ => format!("{}", value as i64),
    }
}

/// The identity of `max`: -inf, or the type's minimum.
pub(super) fn lowest(elem: ElementType) -> f64 {
    match elem {
        ElementType::S8 => i8::MIN as f64,
        ElementType::S16 => i16::MIN as f64,
        ElementType::S32 => i32::MIN as f64,
        ElementType::S64 => i64::MIN as f64,
        e if is_unsigned(e) => 0.0,
        _ => f64::NEG_INFINITY,
    }
}

/// The identity of `min`: +inf, or the type's maximum.
pub(super) fn highest(elem: ElementType) -> f64 {
    match elem {
        ElementType::S8 => i8::MAX as f64,
        ElementType::S16 => i16::MAX as f64,
        ElementType::S32 => i32::MAX as f64,
        ElementType::S64 => i64::MAX as f64,
        ElementType::U8 => u8::MAX as f64,
        ElementType::U16 => u16::MAX as f64,
        ElementType::U32 => u32::MAX as f64,
        ElementType::U64 => u64::MAX as f64,
        ElementType::Pred => 1.0,
        _ => f64::INFINITY,
    }
}

pub(super) fn lowest_finite(elem: ElementType) -> f64 {
    match elem {
        ElementType::F64 => f64::MIN,
        _ => f32::MIN as f64,
    }
}

pub(super) fn min_positive(elem: ElementType) -> f64 {
    match elem {
        ElementType::F64 => f64::MIN_POSITIVE,
        _ => f32::MIN_POSITIVE as f64,
    }
}
