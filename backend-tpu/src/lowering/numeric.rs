//! Lowerings of Burn's numeric ops, shared by float and int tensors:
//! arithmetic with tensors or scalars, comparisons, reductions, cumulative ops.

use burn_ir::{BinaryOpIr, NumericOperationIr, ReduceDimOpIr, ScalarOpIr, UnaryOpIr};

use super::{emit::highest, emit::lowest, is_unsigned, Lowerer, Result, Value};
use crate::pjrt::ElementType;

impl Lowerer {
    pub(super) fn binary_op(&mut self, name: &str, desc: &BinaryOpIr) -> Result<()> {
        let dims = desc.out.shape.to_vec();
        let a = self.input(&desc.lhs)?;
        let b = self.input(&desc.rhs)?;
        let a = self.broadcast(&a, &dims);
        let b = self.broadcast(&b, &dims);
        let b = self.convert(&b, a.ty.elem);
        let y = self.binary(name, &a, &b);
        self.bind(&desc.out, y)
    }

    pub(super) fn scalar_op(&mut self, name: &str, desc: &ScalarOpIr) -> Result<()> {
        let a = self.input(&desc.lhs)?;
        let s = self.scalar(desc.rhs, a.ty.elem);
        let b = self.broadcast(&s, &a.ty.dims);
        let y = self.binary(name, &a, &b);
        self.bind(&desc.out, y)
    }

    pub(super) fn unary_op(&mut self, name: &str, desc: &UnaryOpIr) -> Result<()> {
        let x = self.input(&desc.input)?;
        let y = self.unary(name, &x);
        self.bind(&desc.out, y)
    }

    pub(super) fn comparison(&mut self, direction: &str, desc: &BinaryOpIr) -> Result<()> {
        let dims = desc.out.shape.to_vec();
        let a = self.input(&desc.lhs)?;
        let b = self.input(&desc.rhs)?;
        let a = self.broadcast(&a, &dims);
        let b = self.broadcast(&b, &dims);
        let b = self.convert(&b, a.ty.elem);
        let y = self.compare(direction, &a, &b);
        self.bind(&desc.out, y)
    }

    pub(super) fn comparison_scalar(&mut self, direction: &str, desc: &ScalarOpIr) -> Result<()> {
        let a = self.input(&desc.lhs)?;
        let s = self.scalar(desc.rhs, a.ty.elem);
        let b = self.broadcast(&s, &a.ty.dims);
        let y = self.compare(direction, &a, &b);
        self.bind(&desc.out, y)
    }

    /// Python's remainder: the result takes the sign of the divisor.
    pub(super) fn remainder(&mut self, a: &Value, b: &Value) -> Value {
        let r = self.binary("stablehlo.remainder", a, b);
        if is_unsigned(a.ty.elem) {
            return r;
        }
        let zero = self.filled(0.0, &a.ty);
        let nonzero = self.compare("NE", &r, &zero);
        let r_negative = self.compare("LT", &r, &zero);
        let b_negative = self.compare("LT", b, &zero);
        let signs_differ = self.binary("stablehlo.xor", &r_negative, &b_negative);
        let fix = self.binary("stablehlo.and", &nonzero, &signs_differ);
        let shifted = self.binary("stablehlo.add", &r, b);
        self.select(&fix, &shifted, &r)
    }

    /// Reduces over `axis` keeping it (size 1), in f32 for half types.
    pub(super) fn reduce_dim(&mut self, desc: &ReduceDimOpIr, kind: Reduction) -> Result<()> {
        let x = self.input(&desc.input)?;
        let y = self.reduction(&x, &[desc.axis], kind);
        self.bind(&desc.out, y)
    }

    pub(super) fn reduction(&mut self, x: &Value, axes: &[usize], kind: Reduction) -> Value {
        let elem = x.ty.elem;
        let wide = matches!(kind, Reduction::Sum | Reduction::Mean | Reduction::Prod)
            && matches!(elem, ElementType::F16 | ElementType::BF16);
        let x = if wide {
            self.convert(x, ElementType::F32)
        } else {
            x.clone()
        };
        let (combiner, init) = match kind {
            Reduction::Sum | Reduction::Mean => ("stablehlo.add", 0.0),
            Reduction::Prod => ("stablehlo.multiply", 1.0),
            Reduction::Max => ("stablehlo.maximum", lowest(elem)),
            Reduction::Min => ("stablehlo.minimum", highest(elem)),
        };
        let mut y = self.reduce(&x, axes, combiner, init);
        if kind == Reduction::Mean {
            let count: usize = axes.iter().map(|&a| x.ty.dims[a]).product();
            let n = self.filled(count as f64, &y.ty);
            y = self.binary("stablehlo.divide", &y, &n);
        }
        self.convert(&y, elem)
    }

    pub(super) fn lower_numeric(&mut self, op: &NumericOperationIr) -> Result<()> {
        match op {
            NumericOperationIr::Add(desc) => self.binary_op("stablehlo.add", desc),
            NumericOperationIr::Sub(desc) => self.binary_op("stablehlo.subtract", desc),
            NumericOperationIr::Mul(desc) => self.binary_op("stablehlo.multiply", desc),
            NumericOperationIr::Div(desc) => self.binary_op("stablehlo.divide", desc),
            NumericOperationIr::AddScalar(desc) => self.scalar_op("stablehlo.add", desc),
            NumericOperationIr::SubScalar(desc) => self.scalar_op("stablehlo.subtract", desc),
            NumericOperationIr::MulScalar(desc) => self.scalar_op("stablehlo.multiply", desc),
            NumericOperationIr::DivScalar(desc) => self.scalar_op("stablehlo.divide", desc),
            NumericOperationIr::Rem(desc) => {
                let dims = desc.out.shape.to_vec();
                let a = self.input(&desc.lhs)?;
                let b = self.input(&desc.rhs)?;
                let a = self.broadcast(&a, &dims);
                let b = self.broadcast(&b, &dims);
                let y = self.remainder(&a, &b);
                self.bind(&desc.out, y)
            }
            NumericOperationIr::RemScalar(desc) => {
                let a = self.input(&desc.lhs)?;
                let s = self.scalar(desc.rhs, a.ty.elem);
                let b = self.broadcast(&s, &a.ty.dims);
                let y = self.remainder(&a, &b);
                self.bind(&desc.out, y)
            }
            NumericOperationIr::Abs(desc) => self.unary_op("stablehlo.abs", desc),
            NumericOperationIr::Full(desc) => {
                let ty = self.ty(&desc.out)?;
                let s = self.scalar(desc.value, ty.elem);
                let y = self.broadcast(&s, &ty.dims);
                self.bind(&desc.out, y)
            }
            NumericOperationIr::MeanDim(desc) => self.reduce_dim(desc, Reduction::Mean),
            NumericOperationIr::SumDim(desc) => self.reduce_dim(desc, Reduction::Sum),
            NumericOperationIr::ProdDim(desc) => self.reduce_dim(desc, Reduction::Prod),
            NumericOperationIr::MaxDim(desc) => self.reduce_dim(desc, Reduction::Max),
            NumericOperationIr::MinDim(desc) => self.reduce_dim(desc, Reduction::Min),
            NumericOperationIr::MaxAbsDim(desc) => {
                let x = self.input(&desc.input)?;
                let a = self.unary("stablehlo.abs", &x);
                let y = self.reduction(&a, &[desc.axis], Reduction::Max);
                self.bind(&desc.out, y)
            }
            NumericOperationIr::Mean(desc)
            | NumericOperationIr::Sum(desc)
            | NumericOperationIr::Prod(desc)
            | NumericOperationIr::Max(desc)
            | NumericOperationIr::Min(desc)
            | NumericOperationIr::MaxAbs(desc) => {
                let kind = match op {
                    NumericOperationIr::Mean(_) => Reduction::Mean,
                    NumericOperationIr::Sum(_) => Reduction::Sum,
                    NumericOperationIr::Prod(_) => Reduction::Prod,
                    NumericOperationIr::Min(_) => Reduction::Min,
                    _ => Reduction::Max,
                };
                let mut x = self.input(&desc.input)?;
                if matches!(op, NumericOperationIr::MaxAbs(_)) {
                    x = self.unary("stablehlo.abs", &x);
                }
                let axes = (0..x.ty.rank()).collect::<Vec<_>>();
                let y = self.reduction(&x, &axes, kind);
                self.bind(&desc.out, y)
            }
            NumericOperationIr::Greater(desc) => self.comparison("GT", desc),
            NumericOperationIr::GreaterEqual(desc) => self.comparison("GE", desc),
            NumericOperationIr::Lower(desc) => self.comparison("LT", desc),
            NumericOperationIr::LowerEqual(desc) => self.comparison("LE", desc),
            NumericOperationIr::GreaterElem(desc) => self.comparison_scalar("GT", desc),
            NumericOperationIr::GreaterEqualElem(desc) => self.comparison_scalar("GE", desc),
            NumericOperationIr::LowerElem(desc) => self.comparison_scalar("LT", desc),
            NumericOperationIr::LowerEqualElem(desc) => self.comparison_scalar("LE", desc),
            NumericOperationIr::Clamp(desc) => {
                let x = self.input(&desc.tensor)?;
                let min = self.scalar(desc.min, x.ty.elem);
                let max = self.scalar(desc.max, x.ty.elem);
                let ty = x.ty.clone();
                let y = self.emit("stablehlo.clamp", &[&min, &x, &max], "", ty);
                self.bind(&desc.out, y)
            }
            NumericOperationIr::Powi(desc) => self.binary_op("stablehlo.power", desc),
            NumericOperationIr::PowiScalar(desc) => self.scalar_op("stablehlo.power", desc),
            NumericOperationIr::ArgMax(desc) | NumericOperationIr::ArgMin(desc) => {
                let max = matches!(op, NumericOperationIr::ArgMax(_));
                let x = self.input(&desc.input)?;
                let out_elem = self.elem(desc.out.dtype)?;
                let y = self.arg_reduce(&x, desc.axis, max, out_elem)?;
                self.bind(&desc.out, y)
            }
            NumericOperationIr::MaxDimWithIndices(desc)
            | NumericOperationIr::MinDimWithIndices(desc) => {
                let max = matches!(op, NumericOperationIr::MaxDimWithIndices(_));
                let x = self.input(&desc.tensor)?;
                let kind = if max { Reduction::Max } else { Reduction::Min };
                let values = self.reduction(&x, &[desc.dim], kind);
                self.bind(&desc.out, values)?;
                let index_elem = self.elem(desc.out_indices.dtype)?;
                let indices = self.arg_reduce(&x, desc.dim, max, index_elem)?;
                self.bind(&desc.out_indices, indices)
            }
            NumericOperationIr::CumSum(desc)
            | NumericOperationIr::CumProd(desc)
            | NumericOperationIr::CumMax(desc)
            | NumericOperationIr::CumMin(desc) => {
                let x = self.input(&desc.input)?;
                let elem = x.ty.elem;
                let (combiner, init) = match op {
                    NumericOperationIr::CumSum(_) => ("stablehlo.add", 0.0),
                    NumericOperationIr::CumProd(_) => ("stablehlo.multiply", 1.0),
                    NumericOperationIr::CumMax(_) => ("stablehlo.maximum", lowest(elem)),
                    _ => ("stablehlo.minimum", highest(elem)),
                };
                // A window reaching back over the whole axis.
                let n = x.ty.dims[desc.axis];
                let rank = x.ty.rank();
                let mut window = vec![1; rank];
                window[desc.axis] = n;
                let mut padding = vec![(0, 0); rank];
                padding[desc.axis] = (n.saturating_sub(1), 0);
                let y = self.reduce_window(&x, &window, &vec![1; rank], &padding, combiner, init);
                self.bind(&desc.out, y)
            }
            _ => self.unsupported(""),
        }
    }

    /// Index of the first maximum (or minimum) along `axis`, kept as size 1:
    /// the extreme value, then the smallest index holding it.
    pub(super) fn arg_reduce(
        &mut self,
        x: &Value,
        axis: usize,
        max: bool,
        out_elem: ElementType,
    ) -> Result<Value> {
        let kind = if max { Reduction::Max } else { Reduction::Min };
        let extreme = self.reduction(x, &[axis], kind);
        let mut kept = x.ty.dims.clone();
        kept[axis] = 1;
        let extreme = self.reshape(&extreme, &kept);
        let extreme = self.broadcast(&extreme, &x.ty.dims);
        let hit = self.compare("EQ", x, &extreme);
        let index = self.iota(&x.ty.dims, axis, ElementType::S64);
        let size = x.ty.dims[axis];
        let beyond = self.filled(size as f64, &index.ty);
        let candidates = self.select(&hit, &index, &beyond);
        let first = self.reduce(&candidates, &[axis], "stablehlo.minimum", i64::MAX as f64);
        let first = self.reshape(&first, &kept);
        Ok(self.convert(&first, out_elem))
    }
}

#[derive(Clone, Copy, PartialEq, Eq)]
pub(super) enum Reduction {
    Sum,
    Mean,
    Prod,
    Max,
    Min,
}
