//! What a compiled function takes and returns: [`Oxi`] tensors, alone or in
//! tuples, flattened to router tensors and rebuilt from them.

use burn_ir::TensorIr;
use burn_router::RouterTensor;
use burn_tensor::{Bool, Int, Tensor, TensorPrimitive};

use crate::channel::OxiClient;
use crate::Oxi;

/// What a compiled function takes and returns: an [`Oxi`] tensor (float,
/// int or bool, any rank) or a tuple of up to six of them.
pub trait Tensors: Sized {
    /// Appends the router tensors, in order.
    fn flatten(self, out: &mut Vec<RouterTensor<OxiClient>>);
    /// Rebuilds from router tensors, in the order [`flatten`](Self::flatten)
    /// wrote them.
    fn unflatten(tensors: &mut std::vec::IntoIter<RouterTensor<OxiClient>>) -> Self;
}

fn next_tensor(
    tensors: &mut std::vec::IntoIter<RouterTensor<OxiClient>>,
) -> RouterTensor<OxiClient> {
    tensors
        .next()
        .expect("compiled function: fewer tensors than the signature's type has (a bug)")
}

impl<const D: usize> Tensors for Tensor<Oxi, D> {
    fn flatten(self, out: &mut Vec<RouterTensor<OxiClient>>) {
        out.push(match self.into_primitive() {
            TensorPrimitive::Float(t) | TensorPrimitive::QFloat(t) => t,
        });
    }

    fn unflatten(tensors: &mut std::vec::IntoIter<RouterTensor<OxiClient>>) -> Self {
        Tensor::from_primitive(TensorPrimitive::Float(next_tensor(tensors)))
    }
}

impl<const D: usize> Tensors for Tensor<Oxi, D, Int> {
    fn flatten(self, out: &mut Vec<RouterTensor<OxiClient>>) {
        out.push(self.into_primitive());
    }

    fn unflatten(tensors: &mut std::vec::IntoIter<RouterTensor<OxiClient>>) -> Self {
        Tensor::from_primitive(next_tensor(tensors))
    }
}

impl<const D: usize> Tensors for Tensor<Oxi, D, Bool> {
    fn flatten(self, out: &mut Vec<RouterTensor<OxiClient>>) {
        out.push(self.into_primitive());
    }

    fn unflatten(tensors: &mut std::vec::IntoIter<RouterTensor<OxiClient>>) -> Self {
        Tensor::from_primitive(next_tensor(tensors))
    }
}

macro_rules! tuple_tensors {
    ($($t:ident),+) => {
        impl<$($t: Tensors),+> Tensors for ($($t,)+) {
            #[allow(non_snake_case)]
            fn flatten(self, out: &mut Vec<RouterTensor<OxiClient>>) {
                let ($($t,)+) = self;
                $($t.flatten(out);)+
            }

            fn unflatten(tensors: &mut std::vec::IntoIter<RouterTensor<OxiClient>>) -> Self {
                ($($t::unflatten(tensors),)+)
            }
        }
    };
}

tuple_tensors!(A);
tuple_tensors!(A, B);
tuple_tensors!(A, B, C);
tuple_tensors!(A, B, C, D);
tuple_tensors!(A, B, C, D, E);
tuple_tensors!(A, B, C, D, E, F);

/// The metadata of a router tensor, without consuming or dropping it.
pub(super) fn ir_of(tensor: &RouterTensor<OxiClient>) -> TensorIr {
    // The clone makes the count at least 2, so `into_ir` reports `ReadOnly`
    // and dropping the clone registers nothing.
    tensor.clone().into_ir()
}
