//! Lowerings of Burn's base ops, shared by float, int and bool tensors:
//! reshape, permute, slice, gather, scatter, cat, casts and the like.

use std::fmt::Write as _;

use burn_backend::tensor::IndexingUpdateOp;
use burn_backend::Slice;
use burn_ir::BaseOperationIr;

use super::{emit::i64_array, emit::list, Lowerer, Result, TensorType, Value};
use crate::pjrt::ElementType;

impl Lowerer {
    pub(super) fn lower_base(&mut self, op: &BaseOperationIr) -> Result<()> {
        match op {
            BaseOperationIr::Reshape(desc) => {
                let x = self.input(&desc.input)?;
                let y = self.reshape(&x, &desc.out.shape);
                self.bind(&desc.out, y)
            }
            BaseOperationIr::SwapDims(desc) => {
                let x = self.input(&desc.input)?;
                let mut permutation = (0..x.ty.rank()).collect::<Vec<_>>();
                permutation.swap(desc.dim1, desc.dim2);
                let y = self.transpose(&x, &permutation);
                self.bind(&desc.out, y)
            }
            BaseOperationIr::Permute(desc) => {
                let x = self.input(&desc.input)?;
                let y = self.transpose(&x, &desc.axes);
                self.bind(&desc.out, y)
            }
            BaseOperationIr::Flip(desc) => {
                let x = self.input(&desc.input)?;
                let ty = x.ty.clone();
                let y = self.emit(
                    "stablehlo.reverse",
                    &[&x],
                    &format!("dimensions = {}", i64_array(&desc.axes)),
                    ty,
                );
                self.bind(&desc.out, y)
            }
            BaseOperationIr::Expand(desc) => {
                let x = self.input(&desc.input)?;
                let y = self.broadcast(&x, &desc.out.shape);
                self.bind(&desc.out, y)
            }
            BaseOperationIr::Slice(desc) => {
                let x = self.input(&desc.tensor)?;
                let (start, limit, strides) = self.slice_bounds(&x.ty.dims, &desc.ranges)?;
                let y = self.slice(&x, &start, &limit, &strides);
                self.bind(&desc.out, y)
            }
            BaseOperationIr::SliceAssign(desc) => {
                let x = self.input(&desc.tensor)?;
                let value = self.input(&desc.value)?;
                let (start, _, strides) = self.slice_bounds(&x.ty.dims, &desc.ranges)?;
                if strides.iter().any(|&s| s != 1) {
                    return self.unsupported("slice_assign with a step");
                }
                let indices = start
                    .iter()
                    .map(|&s| self.constant(s as f64, ElementType::S64))
                    .collect::<Vec<_>>();
                let mut operands = vec![&x, &value];
                operands.extend(indices.iter());
                let ty = x.ty.clone();
                let y = self.emit("stablehlo.dynamic_update_slice", &operands, "", ty);
                self.bind(&desc.out, y)
            }
            BaseOperationIr::Gather(desc) => {
                let x = self.input(&desc.tensor)?;
                let indices = self.input(&desc.indices)?;
                let y = self.gather_along(&x, desc.dim, &indices)?;
                self.bind(&desc.out, y)
            }
            BaseOperationIr::Select(desc) => {
                let x = self.input(&desc.tensor)?;
                let indices = self.input(&desc.indices)?;
                let indices = self.convert(&indices, ElementType::S64);
                let y = self.take(&x, desc.dim, &indices);
                self.bind(&desc.out, y)
            }
            BaseOperationIr::Scatter(desc) => {
                let x = self.input(&desc.tensor)?;
                let indices = self.input(&desc.indices)?;
                let values = self.input(&desc.value)?;
                let values = self.convert(&values, x.ty.elem);
                let full = self.full_indices(desc.dim, &indices)?;
                let rank = x.ty.rank();
                let all = (0..rank).collect::<Vec<_>>();
                let numbers = ScatterNumbers {
                    update_window_dims: &[],
                    inserted_window_dims: &all,
                    scatter_dims_to_operand_dims: &all,
                    index_vector_dim: rank,
                };
                let y = self.scatter(&x, &full, &values, &numbers, desc.update);
                self.bind(&desc.out, y)
            }
            BaseOperationIr::SelectAssign(desc) => {
                let x = self.input(&desc.tensor)?;
                let indices = self.input(&desc.indices)?;
                let indices = self.convert(&indices, ElementType::S64);
                let count = indices.ty.dims.first().copied().unwrap_or(1);
                let indices = self.reshape(&indices, &[count, 1]);
                let values = self.input(&desc.value)?;
                let values = self.convert(&values, x.ty.elem);
                let window = (0..x.ty.rank())
                    .filter(|&d| d != desc.dim)
                    .collect::<Vec<_>>();
                let numbers = ScatterNumbers {
                    update_window_dims: &window,
                    inserted_window_dims: &[desc.dim],
                    scatter_dims_to_operand_dims: &[desc.dim],
                    index_vector_dim: 1,
                };
                let y = self.scatter(&x, &indices, &values, &numbers, desc.update);
                self.bind(&desc.out, y)
            }
            BaseOperationIr::MaskWhere(desc) => {
                let dims = desc.out.shape.to_vec();
                let x = self.input(&desc.tensor)?;
                let mask = self.input(&desc.mask)?;
                let value = self.input(&desc.value)?;
                let x = self.broadcast(&x, &dims);
                let mask = self.broadcast(&mask, &dims);
                let value = self.broadcast(&value, &dims);
                let value = self.convert(&value, x.ty.elem);
                let y = self.select(&mask, &value, &x);
                self.bind(&desc.out, y)
            }
            BaseOperationIr::MaskFill(desc) => {
                let dims = desc.out.shape.to_vec();
                let x = self.input(&desc.tensor)?;
                let mask = self.input(&desc.mask)?;
                let x = self.broadcast(&x, &dims);
                let mask = self.broadcast(&mask, &dims);
                let value = self.scalar(desc.value, x.ty.elem);
                let value = self.broadcast(&value, &dims);
                let y = self.select(&mask, &value, &x);
                self.bind(&desc.out, y)
            }
            BaseOperationIr::Equal(desc) => self.comparison("EQ", desc),
            BaseOperationIr::EqualElem(desc) => self.comparison_scalar("EQ", desc),
            BaseOperationIr::RepeatDim(desc) => {
                let x = self.input(&desc.tensor)?;
                let mut expanded = x.ty.dims.clone();
                expanded.insert(desc.dim, desc.times);
                let mapping = (0..x.ty.rank())
                    .map(|d| if d < desc.dim { d } else { d + 1 })
                    .collect::<Vec<_>>();
                let y = self.broadcast_in_dim(&x, &expanded, &mapping);
                let y = self.reshape(&y, &desc.out.shape);
                self.bind(&desc.out, y)
            }
            BaseOperationIr::Cat(desc) => {
                let values = desc
                    .tensors
                    .iter()
                    .map(|t| self.input(t))
                    .collect::<Result<Vec<_>>>()?;
                let refs = values.iter().collect::<Vec<_>>();
                let y = self.concatenate(&refs, desc.dim)?;
                self.bind(&desc.out, y)
            }
            BaseOperationIr::Cast(desc) => {
                let x = self.input(&desc.input)?;
                let elem = self.elem(desc.out.dtype)?;
                let y = self.convert(&x, elem);
                self.bind(&desc.out, y)
            }
            BaseOperationIr::Empty(desc) | BaseOperationIr::Zeros(desc) => {
                let ty = self.ty(&desc.out)?;
                let y = self.filled(0.0, &ty);
                self.bind(&desc.out, y)
            }
            BaseOperationIr::Ones(desc) => {
                let ty = self.ty(&desc.out)?;
                let y = self.filled(1.0, &ty);
                self.bind(&desc.out, y)
            }
            _ => self.unsupported(""),
        }
    }

    /// Start, limit and stride per dimension of Burn slices (missing ranges
    /// take the whole dimension).
    #[allow(clippy::type_complexity)]
    pub(super) fn slice_bounds(
        &self,
        dims: &[usize],
        ranges: &[Slice],
    ) -> Result<(Vec<usize>, Vec<usize>, Vec<usize>)> {
        let mut start = Vec::with_capacity(dims.len());
        let mut limit = Vec::with_capacity(dims.len());
        let mut strides = Vec::with_capacity(dims.len());
        for (d, &size) in dims.iter().enumerate() {
            match ranges.get(d) {
                Some(slice) => {
                    let (range, step) = slice.to_range_and_step(size);
                    if step <= 0 {
                        return self.unsupported("slice with a negative step");
                    }
                    start.push(range.start);
                    limit.push(range.end.max(range.start));
                    strides.push(step as usize);
                }
                None => {
                    start.push(0);
                    limit.push(size);
                    strides.push(1);
                }
            }
        }
        Ok((start, limit, strides))
    }

    /// Burn's `gather(dim, x, indices)`: `out[i][j] = x[i][indices[i][j]]`
    /// for `dim = 1`, indices of the output's shape.
    pub(super) fn gather_along(&mut self, x: &Value, dim: usize, indices: &Value) -> Result<Value> {
        let dims = indices.ty.dims.clone();
        let rank = dims.len();
        if rank != x.ty.rank() {
            return self.internal("gather indices must have the tensor's rank");
        }
        let full = self.full_indices(dim, indices)?;
        let all = (0..rank).collect::<Vec<_>>();
        Ok(self.gather(x, &full, &[], &all, &all, rank, &vec![1; rank], dims))
    }

    /// The full index `[..., rank]` of every element of `indices` with its
    /// own coordinates, except along `dim`, where it is the index's value.
    pub(super) fn full_indices(&mut self, dim: usize, indices: &Value) -> Result<Value> {
        let dims = indices.ty.dims.clone();
        let rank = dims.len();
        let mut with_vector = dims.clone();
        with_vector.push(1);
        let indices = self.convert(indices, ElementType::S64);
        let mut parts = Vec::with_capacity(rank);
        for d in 0..rank {
            let part = if d == dim {
                indices.clone()
            } else {
                self.iota(&dims, d, ElementType::S64)
            };
            parts.push(self.reshape(&part, &with_vector));
        }
        let refs = parts.iter().collect::<Vec<_>>();
        self.concatenate(&refs, rank)
    }

    /// `scatter` of `updates` into `operand` at `indices`, combining with
    /// the existing values as `update` says.
    pub(super) fn scatter(
        &mut self,
        operand: &Value,
        indices: &Value,
        updates: &Value,
        numbers: &ScatterNumbers<'_>,
        update: IndexingUpdateOp,
    ) -> Value {
        let scalar = TensorType::new(Vec::new(), operand.ty.elem).mlir();
        let result = self.fresh();
        let a = self.fresh();
        let b = self.fresh();
        let c = self.fresh();
        let combine = match update {
            IndexingUpdateOp::Assign => None,
            IndexingUpdateOp::Add => Some("stablehlo.add"),
            IndexingUpdateOp::Mul => Some("stablehlo.multiply"),
            IndexingUpdateOp::Min => Some("stablehlo.minimum"),
            IndexingUpdateOp::Max => Some("stablehlo.maximum"),
        };
        let (line, returned) = match combine {
            Some(op) => (
                format!("      {c} = \"{op}\"({a}, {b}) : ({scalar}, {scalar}) -> {scalar}\n"),
                c.clone(),
            ),
            None => (String::new(), b.clone()),
        };
        let mut fields = Vec::new();
        if !numbers.update_window_dims.is_empty() {
            fields.push(format!(
                "update_window_dims = {}",
                list(numbers.update_window_dims)
            ));
        }
        if !numbers.inserted_window_dims.is_empty() {
            fields.push(format!(
                "inserted_window_dims = {}",
                list(numbers.inserted_window_dims)
            ));
        }
        fields.push(format!(
            "scatter_dims_to_operand_dims = {}",
            list(numbers.scatter_dims_to_operand_dims)
        ));
        fields.push(format!("index_vector_dim = {}", numbers.index_vector_dim));
        let _ = writeln!(
            self.body,
            "    {result} = \"stablehlo.scatter\"({}, {}, {}) ({{\n    ^bb0({a}: {scalar}, {b}: {scalar}):\n{line}      \"stablehlo.return\"({returned}) : ({scalar}) -> ()\n    }}) {{indices_are_sorted = false, scatter_dimension_numbers = #stablehlo.scatter<{}>, unique_indices = false}} : ({}, {}, {}) -> {}",
            operand.name,
            indices.name,
            updates.name,
            fields.join(", "),
            operand.ty.mlir(),
            indices.ty.mlir(),
            updates.ty.mlir(),
            operand.ty.mlir()
        );
        Value {
            name: result,
            ty: operand.ty.clone(),
        }
    }
}

/// The dimension numbers of a `stablehlo.scatter`.
pub(super) struct ScatterNumbers<'a> {
    pub(super) update_window_dims: &'a [usize],
    pub(super) inserted_window_dims: &'a [usize],
    pub(super) scatter_dims_to_operand_dims: &'a [usize],
    pub(super) index_vector_dim: usize,
}
