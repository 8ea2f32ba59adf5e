//! Lowerings of the int-only ops: bitwise ops, casts and matmul.

use burn_ir::IntOperationIr;

use super::{Lowerer, Result};

impl Lowerer {
    pub(super) fn lower_int(&mut self, op: &IntOperationIr) -> Result<()> {
        match op {
            IntOperationIr::IntoFloat(d) => {
                let x = self.input(&d.input)?;
                let elem = self.elem(d.out.dtype)?;
                let y = self.convert(&x, elem);
                self.bind(&d.out, y)
            }
            IntOperationIr::BitwiseAnd(d) => self.binary_op("stablehlo.and", d),
            IntOperationIr::BitwiseOr(d) => self.binary_op("stablehlo.or", d),
            IntOperationIr::BitwiseXor(d) => self.binary_op("stablehlo.xor", d),
            IntOperationIr::BitwiseNot(d) => self.unary_op("stablehlo.not", d),
            IntOperationIr::BitwiseAndScalar(d) => self.scalar_op("stablehlo.and", d),
            IntOperationIr::BitwiseOrScalar(d) => self.scalar_op("stablehlo.or", d),
            IntOperationIr::BitwiseXorScalar(d) => self.scalar_op("stablehlo.xor", d),
            IntOperationIr::BitwiseLeftShift(d) => self.binary_op("stablehlo.shift_left", d),
            IntOperationIr::BitwiseLeftShiftScalar(d) => self.scalar_op("stablehlo.shift_left", d),
            IntOperationIr::BitwiseRightShift(d) => {
                self.binary_op("stablehlo.shift_right_arithmetic", d)
            }
            IntOperationIr::BitwiseRightShiftScalar(d) => {
                self.scalar_op("stablehlo.shift_right_arithmetic", d)
            }
            IntOperationIr::Matmul(d) => self.matmul(&d.lhs, &d.rhs, &d.out),
        }
    }
}
