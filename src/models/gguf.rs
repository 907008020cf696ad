//! Weights of the GGUF models: what `QuantizedLlama` and `QuantizedGemma3`
//! share between reading a file and computing logits.
//!
//! * [`check_activation_dtype`] - the activation dtypes a GGUF model runs
//!   in (f32, bf16, f16).
//! * [`GgufWeights`] - tensors by name from a GGUF file onto a device:
//!   quantized `QMatMul`s or, when dequantizing, dense ones in one dtype;
//!   one layer's projections of one input joined ([`QProjections`]); norm
//!   weights and the embedding table as dense tensors; the output matrix,
//!   tied to the embeddings when the file has none.
//! * [`lm_head`] - the tail of a forward pass: the requested rows, the final
//!   norm, the output projection, f32 logits.

use std::io::{Read, Seek, SeekFrom};

use candle_core::quantized::{gguf_file, GgmlDType, QMatMul, QTensor};
use candle_core::{bail, DType, Device, Module, Result, Tensor};

use super::layers::QProjections;
use super::limits::gguf::check_tensor;
use super::select_rows;
use crate::metadata::AttentionMetadata;

/// Fails unless `dtype` is an activation dtype of the GGUF models: f32,
/// bf16 or f16. `component` names the model in the message.
pub(crate) fn check_activation_dtype(component: &str, dtype: DType) -> Result<()> {
    match dtype {
        DType::F32 | DType::BF16 | DType::F16 => Ok(()),
        _ => bail!("{component}: activations must be f32, bf16 or f16, got {dtype:?}"),
    }
}

/// Reads a model's tensors out of GGUF content `ct` (from `reader`) onto
/// `device`.
pub(crate) struct GgufWeights<'a, R> {
    /// The model named in error messages.
    component: &'static str,
    ct: &'a gguf_file::Content,
    reader: &'a mut R,
    device: &'a Device,
    /// The activation dtype: the matmuls' input.
    activation: DType,
    /// `activation` when the weights are dequantized at load time; `None`
    /// keeps them quantized.
    dense: Option<DType>,
}

impl<'a, R: Read + Seek> GgufWeights<'a, R> {
    /// Matrices for activations in `activation` (f32, bf16 or f16): kept
    /// quantized, or dequantized to `activation` when `dequantize`.
    /// Matrices stored as floats (F32, F16, BF16), which candle's `QMatMul`
    /// holds as dense f32, are converted to `activation` in any case, so
    /// that every matmul takes the activations as they are.
    pub(crate) fn new(
        component: &'static str,
        ct: &'a gguf_file::Content,
        reader: &'a mut R,
        device: &'a Device,
        activation: DType,
        dequantize: bool,
    ) -> Result<Self> {
        check_activation_dtype(component, activation)?;
        Ok(Self {
            component,
            ct,
            reader,
            device,
            activation,
            dense: dequantize.then_some(activation),
        })
    }

    /// The dense dtype of matrices stored as `stored`, if they are dense.
    fn dense_for(&self, stored: GgmlDType) -> Option<DType> {
        let float = matches!(stored, GgmlDType::F32 | GgmlDType::F16 | GgmlDType::BF16);
        self.dense
            .or((float && self.activation != DType::F32).then_some(self.activation))
    }

    /// The tensor `name` as stored, on `device`; its shape and bytes are
    /// checked against the file first ([`limits::gguf::check_tensor`]: the
    /// content may come from candle's unchecked reader).
    fn qtensor(&mut self, name: &str, device: &Device) -> Result<QTensor> {
        let Some(info) = self.ct.tensor_infos.get(name) else {
            bail!("{}: the GGUF file has no tensor {name}", self.component);
        };
        let file_size = self.reader.seek(SeekFrom::End(0))?;
        check_tensor(name, info, self.ct.tensor_data_offset, file_size)?;
        self.ct.tensor(self.reader, name, device)
    }

    /// The matrix `name` (`(out, in)`) as a `QMatMul`: quantized, or dense
    /// in the load's dtype.
    pub(crate) fn matmul(&mut self, name: &str) -> Result<QMatMul> {
        let t = self.qtensor(name, self.device)?;
        self.to_matmul(t)
    }

    fn to_matmul(&self, t: QTensor) -> Result<QMatMul> {
        match self.dense_for(t.dtype()) {
            Some(dtype) => Ok(QMatMul::Tensor(t.dequantize(self.device)?.to_dtype(dtype)?)),
            None => QMatMul::from_qtensor(t),
        }
    }

    /// The matrices `names`, projections of one input, as one
    /// [`QProjections`] (joined on the host, then moved to the device).
    pub(crate) fn joined(&mut self, names: &[String]) -> Result<QProjections> {
        let weights = names
            .iter()
            .map(|n| self.qtensor(n, &Device::Cpu))
            .collect::<Result<Vec<_>>>()?;
        // Dense when any is (a mixed set then runs as one dense matmul).
        let dense = weights.iter().find_map(|w| self.dense_for(w.dtype()));
        QProjections::new(self.component, weights, self.device, dense)
    }

    /// The tensor `name` dequantized to f32, checked to be `dims`.
    pub(crate) fn dense_f32(&mut self, name: &str, dims: &[usize]) -> Result<Tensor> {
        let w = self.qtensor(name, self.device)?.dequantize(self.device)?;
        if w.dims() != dims {
            bail!(
                "{}: {name} must be {dims:?}, got {:?}",
                self.component,
                w.dims()
            );
        }
        Ok(w)
    }

    /// `token_embd` as stored, and dequantized to f32 `(vocab, hidden)` for
    /// the lookup; fails unless its width is `hidden`.
    pub(crate) fn embeddings(&mut self, hidden: usize) -> Result<(QTensor, Tensor)> {
        let embd_q = self.qtensor("token_embd.weight", self.device)?;
        let embd = embd_q.dequantize(self.device)?;
        let (_, width) = embd.dims2()?;
        if width != hidden {
            bail!(
                "{}: token_embd has width {width}, the embedding length is {hidden}",
                self.component
            );
        }
        Ok((embd_q, embd))
    }

    /// The output matrix `output`, or, when the file has none (tied
    /// embeddings), `embd_q` (`token_embd` as stored). When that is dense,
    /// a tied output shares `table` if given and of the dense dtype (the
    /// caller's lookup table, when it is the plain dequantized one).
    pub(crate) fn output(&mut self, embd_q: QTensor, table: Option<&Tensor>) -> Result<QMatMul> {
        if self.ct.tensor_infos.contains_key("output.weight") {
            return self.matmul("output.weight");
        }
        match (self.dense_for(embd_q.dtype()), table) {
            (Some(dtype), Some(t)) if t.dtype() == dtype => Ok(QMatMul::Tensor(t.clone())),
            _ => self.to_matmul(embd_q),
        }
    }
}

/// Logits of the query rows `rows` of `(num_tokens, hidden)` hidden states
/// `x`: those rows, normed by `norm`, through `output`; `(rows.len(),
/// vocab)` f32 whatever the activation dtype.
pub(crate) fn lm_head(
    component: &str,
    x: &Tensor,
    rows: &[usize],
    metadata: &AttentionMetadata,
    norm: &impl Module,
    output: &QMatMul,
) -> Result<Tensor> {
    let x = select_rows(component, x, rows, metadata)?.apply(norm)?;
    output.forward(&x)?.to_dtype(DType::F32)
}
