//! GGUF files checked before candle's reader sees them.
//!
//! candle-core's `gguf_file::Content::read` bounds the counts and lengths
//! of the header against the file size, but it divides by
//! `general.alignment` unchecked (0 panics), keeps a value's integer type
//! loose (a u64 alignment is silently replaced by 32), and takes tensor
//! shapes as declared: a tensor of `2^60 x 16` elements wraps to an empty
//! one. [`read_gguf`] walks the metadata first with limits of its own
//! (value nesting, array lengths, string lengths, the alignment), then lets
//! candle read the header, then checks every tensor's element count and
//! bytes against the file ([`check_tensor`]).

use std::io::{BufReader, Read, Seek, SeekFrom};

use candle_core::quantized::gguf_file::{Content, TensorInfo};
use candle_core::{bail, Result};

const OP: &str = "gguf";

/// The most elements one metadata array may hold: 8,388,608 (the largest
/// vocabularies have about 262,144 tokens and 280,000 merges).
pub const MAX_ARRAY_ELEMENTS: u64 = 1 << 23;
/// The most array elements all metadata values may hold together.
pub const MAX_TOTAL_ELEMENTS: u64 = 1 << 24;
/// The most bytes one metadata string may hold (64 MiB).
pub const MAX_STRING_BYTES: u64 = 1 << 26;
/// The most bytes of a metadata key.
pub const MAX_KEY_BYTES: u64 = 1 << 16;
/// The deepest nesting of arrays in a metadata value (real files nest 1).
pub const MAX_VALUE_DEPTH: usize = 8;
/// The largest `general.alignment`.
pub const MAX_ALIGNMENT: u64 = 1 << 20;

/// Reads the header of the GGUF file in `reader` (from its current
/// position), checking it first: the metadata walk of this module, candle's
/// reader, then every tensor's shape, dtype and bytes against the file
/// ([`check_tensor`]).
///
/// Fails with a message that names `general.alignment`, the metadata key,
/// or the tensor, and the bad value.
pub fn read_gguf<R: Read + Seek>(reader: &mut R) -> Result<Content> {
    let start = reader.stream_position()?;
    let file_size = reader.seek(SeekFrom::End(0))?;
    reader.seek(SeekFrom::Start(start))?;
    {
        let mut walk = HeaderWalk {
            reader: BufReader::new(&mut *reader),
            position: start,
            file_size,
            long_lengths: true,
            elements: 0,
        };
        walk.header()?;
    }
    reader.seek(SeekFrom::Start(start))?;
    let content = Content::read(reader)?;
    for (name, info) in &content.tensor_infos {
        check_tensor(name, info, content.tensor_data_offset, file_size)?;
    }
    Ok(content)
}

/// Checks one tensor of a GGUF file of `file_size` bytes whose tensor data
/// starts at `data_offset`: no dimension is 0, the element count does not
/// overflow and is a whole number of the dtype's blocks, and the tensor's
/// bytes lie inside the file. Returns its size in bytes.
pub fn check_tensor(
    name: &str,
    info: &TensorInfo,
    data_offset: u64,
    file_size: u64,
) -> Result<u64> {
    let dims = info.shape.dims();
    if dims.contains(&0) {
        bail!("{OP}: tensor {name} has a zero dimension: {dims:?}");
    }
    let Some(elements) = dims
        .iter()
        .try_fold(1u64, |acc, &d| acc.checked_mul(d as u64))
        .filter(|&e| usize::try_from(e).is_ok())
    else {
        bail!("{OP}: tensor {name} of shape {dims:?} has more elements than fit in 64 bits");
    };
    let block = info.ggml_dtype.block_size() as u64;
    if !elements.is_multiple_of(block) {
        bail!(
            "{OP}: tensor {name} of shape {dims:?} has {elements} elements, not a whole number of {:?} blocks of {block}",
            info.ggml_dtype
        );
    }
    let bytes = (elements / block).checked_mul(info.ggml_dtype.type_size() as u64);
    let end = data_offset
        .checked_add(info.offset)
        .and_then(|s| bytes.and_then(|b| s.checked_add(b)));
    match (bytes, end) {
        (Some(bytes), Some(end)) if end <= file_size => Ok(bytes),
        _ => bail!(
            "{OP}: tensor {name} of shape {dims:?} ({:?}) at offset {} does not fit in the file of {file_size} bytes",
            info.ggml_dtype,
            info.offset
        ),
    }
}

/// The metadata value types of GGUF (the spec's `gguf_metadata_value_type`).
#[derive(Clone, Copy, Debug, PartialEq)]
enum ValueType {
    Fixed(u64),
    Bool,
    String,
    Array,
}

impl ValueType {
    fn from_u32(key: &str, v: u32) -> Result<Self> {
        Ok(match v {
            0 | 1 => Self::Fixed(1),
            2 | 3 => Self::Fixed(2),
            4..=6 => Self::Fixed(4),
            7 => Self::Bool,
            8 => Self::String,
            9 => Self::Array,
            10..=12 => Self::Fixed(8),
            _ => bail!("{OP}: metadata {key} has an unknown value type {v}"),
        })
    }

    /// Whether `v` is one of the integer types candle reads an alignment of.
    fn is_alignment_integer(v: u32) -> bool {
        v <= 5
    }
}

/// A bounded walk over a GGUF header's metadata.
struct HeaderWalk<R> {
    reader: R,
    /// Bytes from the start of the file up to the reader's position.
    position: u64,
    file_size: u64,
    /// Lengths and counts are u64 (versions 2 and 3) or u32 (version 1).
    long_lengths: bool,
    /// Array elements seen so far.
    elements: u64,
}

impl<R: Read + Seek> HeaderWalk<R> {
    fn remaining(&self) -> u64 {
        self.file_size.saturating_sub(self.position)
    }

    fn bytes<const N: usize>(&mut self, what: &str) -> Result<[u8; N]> {
        let mut b = [0u8; N];
        if self.remaining() < N as u64 || self.reader.read_exact(&mut b).is_err() {
            bail!(
                "{OP}: the file ends inside {what} (at byte {} of {})",
                self.position,
                self.file_size
            );
        }
        self.position += N as u64;
        Ok(b)
    }

    fn u32(&mut self, what: &str) -> Result<u32> {
        Ok(u32::from_le_bytes(self.bytes::<4>(what)?))
    }

    fn length(&mut self, what: &str) -> Result<u64> {
        match self.long_lengths {
            true => Ok(u64::from_le_bytes(self.bytes::<8>(what)?)),
            false => Ok(self.u32(what)? as u64),
        }
    }

    fn skip(&mut self, n: u64, what: &str) -> Result<()> {
        if n > self.remaining() {
            bail!(
                "{OP}: {what} needs {n} bytes at byte {}, only {} remain in the file",
                self.position,
                self.remaining()
            );
        }
        self.reader.seek_relative(n as i64)?;
        self.position += n;
        Ok(())
    }

    /// A string's length, checked against `limit` and the file.
    fn string_length(&mut self, what: &str, limit: u64) -> Result<u64> {
        let len = self.length(what)?;
        if len > limit || len > self.remaining() {
            bail!(
                "{OP}: {what} is {len} bytes long; the limit is {limit} and {} bytes remain in the file",
                self.remaining()
            );
        }
        Ok(len)
    }

    fn header(&mut self) -> Result<()> {
        let magic = self.u32("the magic number")?;
        if magic != 0x4655_4747 && magic != 0x4747_5546 {
            bail!("{OP}: not a GGUF file (magic 0x{magic:08x})");
        }
        let version = self.u32("the version")?;
        self.long_lengths = match version {
            1 => false,
            2 | 3 => true,
            v => bail!("{OP}: unsupported GGUF version {v}"),
        };
        let _tensor_count = self.length("the tensor count")?;
        let kv_count = self.length("the metadata count")?;
        // Each entry takes at least a key length, a type and one byte.
        let min_entry = if self.long_lengths { 13 } else { 9 };
        if kv_count.saturating_mul(min_entry) > self.remaining() {
            bail!(
                "{OP}: the header declares {kv_count} metadata entries, more than the {} bytes left can hold",
                self.remaining()
            );
        }
        for i in 0..kv_count {
            let len = self.string_length(&format!("metadata key {i}"), MAX_KEY_BYTES)?;
            let mut key = vec![0u8; len as usize];
            if self.reader.read_exact(&mut key).is_err() {
                bail!("{OP}: the file ends inside metadata key {i}");
            }
            self.position += len;
            let key = String::from_utf8_lossy(&key)
                .trim_end_matches('\0')
                .to_string();
            let ty = self.u32(&format!("the type of metadata {key}"))?;
            if key == "general.alignment" {
                self.alignment(ty)?;
            } else {
                self.value(&key, ty, 0)?;
            }
        }
        Ok(())
    }

    /// `general.alignment`: an integer power of two up to [`MAX_ALIGNMENT`],
    /// of a type candle reads (u8, i8, u16, i16, u32, i32).
    fn alignment(&mut self, ty: u32) -> Result<()> {
        const KEY: &str = "general.alignment";
        if !ValueType::is_alignment_integer(ty) {
            bail!("{OP}: {KEY} must be a u32, got a value of type {ty}");
        }
        let value = match ty {
            0 => u8::from_le_bytes(self.bytes::<1>(KEY)?) as i64,
            1 => i8::from_le_bytes(self.bytes::<1>(KEY)?) as i64,
            2 => u16::from_le_bytes(self.bytes::<2>(KEY)?) as i64,
            3 => i16::from_le_bytes(self.bytes::<2>(KEY)?) as i64,
            4 => u32::from_le_bytes(self.bytes::<4>(KEY)?) as i64,
            _ => i32::from_le_bytes(self.bytes::<4>(KEY)?) as i64,
        };
        let ok = u64::try_from(value).is_ok_and(|v| v.is_power_of_two() && v <= MAX_ALIGNMENT);
        if !ok {
            bail!("{OP}: {KEY} must be a power of two in 1..={MAX_ALIGNMENT}, got {value}");
        }
        Ok(())
    }

    /// Skips one value of type `ty` of metadata `key`, `depth` arrays deep.
    fn value(&mut self, key: &str, ty: u32, depth: usize) -> Result<()> {
        match ValueType::from_u32(key, ty)? {
            ValueType::Fixed(n) => self.skip(n, &format!("metadata {key}")),
            ValueType::Bool => {
                let b = self.bytes::<1>(key)?[0];
                if b > 1 {
                    bail!("{OP}: metadata {key} is a bool of value {b}");
                }
                Ok(())
            }
            ValueType::String => {
                let what = format!("the string of metadata {key}");
                let len = self.string_length(&what, MAX_STRING_BYTES)?;
                self.skip(len, &what)
            }
            ValueType::Array => {
                if depth >= MAX_VALUE_DEPTH {
                    bail!("{OP}: metadata {key} nests arrays deeper than {MAX_VALUE_DEPTH}");
                }
                let elem = self.u32(&format!("the element type of metadata {key}"))?;
                let len = self.length(&format!("the length of metadata {key}"))?;
                self.elements = self.elements.saturating_add(len);
                if len > MAX_ARRAY_ELEMENTS || self.elements > MAX_TOTAL_ELEMENTS {
                    bail!(
                        "{OP}: metadata {key} is an array of {len} elements; the limits are {MAX_ARRAY_ELEMENTS} per array and {MAX_TOTAL_ELEMENTS} in all"
                    );
                }
                match ValueType::from_u32(key, elem)? {
                    // Fixed-size elements are skipped at once.
                    ValueType::Fixed(n) => {
                        self.skip(len.saturating_mul(n), &format!("metadata {key}"))
                    }
                    ValueType::Bool => self.skip(len, &format!("metadata {key}")),
                    _ => (0..len).try_for_each(|_| self.value(key, elem, depth + 1)),
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use candle_core::quantized::gguf_file::{self, Value};
    use candle_core::quantized::{GgmlDType, QTensor};
    use candle_core::{Device, Tensor};
    use std::io::Cursor;

    /// A GGUF file with `metadata` and one f32 tensor `t` of `(2, 16)`.
    fn file(metadata: &[(&str, Value)]) -> Vec<u8> {
        let t = QTensor::quantize(
            &Tensor::zeros((2, 16), candle_core::DType::F32, &Device::Cpu).unwrap(),
            GgmlDType::F32,
        )
        .unwrap();
        let md: Vec<(&str, &Value)> = metadata.iter().map(|(k, v)| (*k, v)).collect();
        let mut out = Cursor::new(Vec::new());
        gguf_file::write(&mut out, &md, &[("t", &t)]).unwrap();
        out.into_inner()
    }

    /// The first line of the error (candle appends a backtrace when
    /// `RUST_BACKTRACE` is set).
    fn err(bytes: Vec<u8>) -> String {
        let e = read_gguf(&mut Cursor::new(bytes)).unwrap_err().to_string();
        e.lines().next().unwrap_or_default().to_string()
    }

    #[test]
    fn a_valid_file_reads_as_candle_reads_it() {
        let bytes = file(&[("general.alignment", Value::U32(64))]);
        let ours = read_gguf(&mut Cursor::new(bytes.clone())).unwrap();
        let theirs = Content::read(&mut Cursor::new(bytes)).unwrap();
        assert_eq!(ours.tensor_data_offset, theirs.tensor_data_offset);
        assert_eq!(ours.tensor_infos["t"].shape.dims(), &[2, 16]);
    }

    #[test]
    fn a_zero_or_odd_alignment_is_refused_before_candle_divides_by_it() {
        for (v, shown) in [
            (Value::U32(0), "0"),
            (Value::U32(24), "24"),
            (Value::I32(-8), "-8"),
        ] {
            assert_eq!(
                err(file(&[("general.alignment", v)])),
                format!(
                    "gguf: general.alignment must be a power of two in 1..=1048576, got {shown}"
                )
            );
        }
        assert_eq!(
            err(file(&[("general.alignment", Value::U64(32))])),
            "gguf: general.alignment must be a u32, got a value of type 10"
        );
    }

    #[test]
    fn a_tensor_whose_element_count_overflows_is_refused() {
        let mut bytes = file(&[]);
        // The tensor info: name "t" (u64 length 1 + 1 byte), n_dims u32 = 2,
        // then the dims as u64 (16, 2 reversed in the file).
        let at = bytes
            .windows(9)
            .position(|w| w == [1, 0, 0, 0, 0, 0, 0, 0, b't'])
            .unwrap();
        let dims = at + 9 + 4;
        bytes[dims + 8..dims + 16].copy_from_slice(&(1u64 << 60).to_le_bytes());
        assert_eq!(
            err(bytes),
            "gguf: tensor t of shape [1152921504606846976, 16] has more elements than fit in 64 bits"
        );
    }

    #[test]
    fn a_tensor_past_the_end_of_the_file_is_refused() {
        let mut bytes = file(&[]);
        bytes.truncate(bytes.len() - 4);
        assert!(err(bytes)
            .contains("tensor t of shape [2, 16] (F32) at offset 0 does not fit in the file"));
    }

    #[test]
    fn long_and_deep_metadata_is_refused() {
        let long = Value::Array(vec![Value::U8(0); 10]);
        let mut bytes = file(&[("a", long)]);
        // Rewrite the array's length (after key "a", type 9, element type 0).
        let at = bytes
            .windows(9)
            .position(|w| w == [1, 0, 0, 0, 0, 0, 0, 0, b'a'])
            .unwrap();
        let len = at + 9 + 4 + 4;
        bytes[len..len + 8].copy_from_slice(&(MAX_ARRAY_ELEMENTS + 1).to_le_bytes());
        assert!(err(bytes).starts_with("gguf: metadata a is an array of 8388609 elements"));
        let mut deep = Value::U8(1);
        for _ in 0..=MAX_VALUE_DEPTH {
            deep = Value::Array(vec![deep]);
        }
        assert_eq!(
            err(file(&[("d", deep)])),
            "gguf: metadata d nests arrays deeper than 8"
        );
    }

    #[test]
    fn truncated_headers_are_refused_at_every_length() {
        let bytes = file(&[("general.name", Value::String("m".into()))]);
        for n in 0..bytes.len() {
            assert!(
                read_gguf(&mut Cursor::new(bytes[..n].to_vec())).is_err(),
                "{n}"
            );
        }
    }
}
