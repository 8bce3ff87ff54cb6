//! TensorBoard event files written from Rust, so `tensorboard --logdir runs` shows a run.
//!
//! An event file is a TFRecord stream: per record `u64 length`, `u32 masked-crc32c(length)`,
//! `data`, `u32 masked-crc32c(data)`, all little-endian. Each record is an `Event` protobuf,
//! encoded here by hand (only the fields TensorBoard needs for scalars):
//! `Event { 1: double wall_time, 2: int64 step, 3: string file_version, 5: Summary summary }`,
//! `Summary { 1: repeated Value value }`, `Value { 1: string tag, 2: float simple_value }`.
//! The reader ([`read_scalars`]) decodes the same subset and checks every CRC; it exists so tests
//! (and a curious user) can verify what was written without Python.
use anyhow::{bail, ensure, Context, Result};
use serde_json::{Map, Value};
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

/// CRC-32C (Castagnoli, reflected polynomial 0x82F63B78), table-driven.
fn crc32c(data: &[u8]) -> u32 {
    const TABLE: [u32; 256] = {
        let mut t = [0u32; 256];
        let mut i = 0;
        while i < 256 {
            let mut c = i as u32;
            let mut k = 0;
            while k < 8 {
                c = if c & 1 != 0 { (c >> 1) ^ 0x82F6_3B78 } else { c >> 1 };
                k += 1;
            }
            t[i] = c;
            i += 1;
        }
        t
    };
    !data.iter().fold(!0u32, |c, &b| TABLE[((c ^ b as u32) & 0xff) as usize] ^ (c >> 8))
}

/// TFRecord's masked CRC: rotate right by 15 and add a constant (so CRCs of CRCs stay useful).
fn masked_crc(data: &[u8]) -> u32 {
    crc32c(data).rotate_right(15).wrapping_add(0xa282_ead8)
}

fn varint(out: &mut Vec<u8>, mut v: u64) {
    while v >= 0x80 {
        out.push((v as u8) | 0x80);
        v >>= 7;
    }
    out.push(v as u8);
}

/// A length-delimited field (wire type 2).
fn bytes_field(out: &mut Vec<u8>, field: u32, data: &[u8]) {
    varint(out, ((field << 3) | 2) as u64);
    varint(out, data.len() as u64);
    out.extend_from_slice(data);
}

/// The protobuf `Event` for one step's scalars (or the file-version header when `scalars` is empty
/// and `file_version` is given).
fn encode_event(wall_time: f64, step: i64, file_version: Option<&str>, scalars: &[(&str, f32)]) -> Vec<u8> {
    let mut ev = vec![0x09]; // field 1, fixed64
    ev.extend_from_slice(&wall_time.to_le_bytes());
    ev.push(0x10); // field 2, varint; int64 negatives are ten-byte two's complement
    varint(&mut ev, step as u64);
    if let Some(v) = file_version {
        bytes_field(&mut ev, 3, v.as_bytes());
    }
    if !scalars.is_empty() {
        let mut summary = vec![];
        for (tag, x) in scalars {
            let mut value = vec![];
            bytes_field(&mut value, 1, tag.as_bytes());
            value.push(0x15); // field 2, fixed32
            value.extend_from_slice(&x.to_le_bytes());
            bytes_field(&mut summary, 1, &value);
        }
        bytes_field(&mut ev, 5, &summary);
    }
    ev
}

fn write_record(w: &mut impl Write, data: &[u8]) -> std::io::Result<()> {
    let len = (data.len() as u64).to_le_bytes();
    w.write_all(&len)?;
    w.write_all(&masked_crc(&len).to_le_bytes())?;
    w.write_all(data)?;
    w.write_all(&masked_crc(data).to_le_bytes())
}

/// Appends scalar summaries to a fresh `events.out.tfevents.*` file in a directory.
pub struct TbWriter {
    path: PathBuf,
    out: BufWriter<File>,
}

impl TbWriter {
    /// Creates `dir` if needed and a new event file in it (a resumed run gets a second file;
    /// TensorBoard merges the files of one directory).
    pub fn new(dir: impl AsRef<Path>) -> Result<Self> {
        let dir = dir.as_ref();
        std::fs::create_dir_all(dir).with_context(|| format!("creating {}", dir.display()))?;
        let now = std::time::SystemTime::now().duration_since(std::time::UNIX_EPOCH).unwrap_or_default();
        let name =
            format!("events.out.tfevents.{}.ragen-lab.{}.{}", now.as_secs(), std::process::id(), now.subsec_nanos());
        let path = dir.join(name);
        let file = File::create(&path).with_context(|| format!("creating {}", path.display()))?;
        let mut w = TbWriter { path, out: BufWriter::new(file) };
        w.record(&encode_event(now.as_secs_f64(), 0, Some("brain.Event:2"), &[]))?;
        Ok(w)
    }

    pub fn path(&self) -> &Path {
        &self.path
    }

    fn record(&mut self, data: &[u8]) -> Result<()> {
        write_record(&mut self.out, data).with_context(|| format!("writing {}", self.path.display()))
    }

    /// Every numeric entry of a metrics line (except `step` and `time`) as one event, then flush
    /// so a live TensorBoard sees the step.
    pub fn metrics(&mut self, step: u64, wall_time: f64, line: &Map<String, Value>) -> Result<()> {
        let scalars: Vec<(&str, f32)> = line
            .iter()
            .filter(|(k, _)| k.as_str() != "step" && k.as_str() != "time")
            .filter_map(|(k, v)| Some((k.as_str(), v.as_f64()? as f32)))
            .collect();
        if !scalars.is_empty() {
            self.record(&encode_event(wall_time, step as i64, None, &scalars))?;
        }
        self.flush()
    }

    pub fn flush(&mut self) -> Result<()> {
        self.out.flush().with_context(|| format!("writing {}", self.path.display()))
    }
}

/// Writes `run/tb/` from `run/metrics.jsonl` when the trainer left no event file there (a run
/// from before TensorBoard output, or copied without it). Returns the event file written, if any.
pub fn ensure_tb(run: &Path) -> Result<Option<PathBuf>> {
    let tb = run.join("tb");
    let has_events = std::fs::read_dir(&tb)
        .map(|d| d.flatten().any(|e| e.file_name().to_string_lossy().contains("tfevents")))
        .unwrap_or(false);
    if has_events {
        return Ok(None);
    }
    let lines = super::run::read_metrics(&run.join("metrics.jsonl"))?;
    if lines.is_empty() {
        // Nothing to convert; and a live run's trainer will create tb/ itself.
        return Ok(None);
    }
    let mut w = TbWriter::new(&tb)?;
    for line in &lines {
        let time = line.get("time").and_then(Value::as_f64).unwrap_or(0.0);
        w.metrics(super::run::step_of(line), time, line)?;
    }
    Ok(Some(w.path().to_path_buf()))
}

/// One decoded scalar: (tag, step, value, wall time).
#[derive(Clone, Debug, PartialEq)]
pub struct Scalar {
    pub tag: String,
    pub step: i64,
    pub value: f32,
    pub wall_time: f64,
}

/// Reads an event file back, checking the framing and both CRCs of every record.
pub fn read_scalars(path: &Path) -> Result<Vec<Scalar>> {
    let data = std::fs::read(path).with_context(|| format!("reading {}", path.display()))?;
    let mut out = vec![];
    let mut at = 0;
    while at < data.len() {
        ensure!(data.len() - at >= 12, "{}: truncated record header at byte {at}", path.display());
        let len_bytes = &data[at..at + 8];
        let len = u64::from_le_bytes(len_bytes.try_into().unwrap()) as usize;
        let crc = u32::from_le_bytes(data[at + 8..at + 12].try_into().unwrap());
        ensure!(crc == masked_crc(len_bytes), "{}: bad length crc at byte {at}", path.display());
        let body = at + 12;
        ensure!(data.len() >= body + len + 4, "{}: truncated record at byte {at}", path.display());
        let rec = &data[body..body + len];
        let crc = u32::from_le_bytes(data[body + len..body + len + 4].try_into().unwrap());
        ensure!(crc == masked_crc(rec), "{}: bad data crc at byte {at}", path.display());
        decode_event(rec, &mut out).with_context(|| format!("{}: record at byte {at}", path.display()))?;
        at = body + len + 4;
    }
    Ok(out)
}

/// Protobuf fields of one message: (field number, wire type, payload).
fn fields(mut b: &[u8]) -> Result<Vec<(u32, u8, &[u8])>> {
    fn read_varint(b: &mut &[u8]) -> Result<u64> {
        let mut v = 0u64;
        for shift in (0..64).step_by(7) {
            let (&byte, rest) = b.split_first().context("truncated varint")?;
            *b = rest;
            v |= ((byte & 0x7f) as u64) << shift;
            if byte & 0x80 == 0 {
                return Ok(v);
            }
        }
        bail!("varint too long")
    }
    let mut out = vec![];
    while !b.is_empty() {
        let key = read_varint(&mut b)?;
        let (field, wire) = ((key >> 3) as u32, (key & 7) as u8);
        let n = match wire {
            0 => {
                let start = b;
                read_varint(&mut b)?;
                out.push((field, wire, &start[..start.len() - b.len()]));
                continue;
            }
            1 => 8,
            2 => read_varint(&mut b)? as usize,
            5 => 4,
            w => bail!("unsupported wire type {w}"),
        };
        ensure!(b.len() >= n, "truncated field {field}");
        out.push((field, wire, &b[..n]));
        b = &b[n..];
    }
    Ok(out)
}

fn decode_event(rec: &[u8], out: &mut Vec<Scalar>) -> Result<()> {
    let (mut wall_time, mut step) = (0.0, 0i64);
    let mut summaries = vec![];
    for (field, _, v) in fields(rec)? {
        match field {
            1 => wall_time = f64::from_le_bytes(v.try_into()?),
            2 => {
                let mut x = 0u64;
                for (i, b) in v.iter().enumerate() {
                    x |= ((b & 0x7f) as u64) << (7 * i);
                }
                step = x as i64;
            }
            5 => summaries.push(v),
            _ => {}
        }
    }
    for s in summaries {
        for (_, _, value) in fields(s)?.into_iter().filter(|f| f.0 == 1) {
            let (mut tag, mut x) = (String::new(), None);
            for (field, _, v) in fields(value)? {
                match field {
                    1 => tag = String::from_utf8(v.to_vec())?,
                    2 => x = Some(f32::from_le_bytes(v.try_into()?)),
                    _ => {}
                }
            }
            if let Some(value) = x {
                out.push(Scalar { tag, step, value, wall_time });
            }
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn crc32c_matches_the_rfc3720_check_values() {
        assert_eq!(crc32c(b"123456789"), 0xE306_9283);
        assert_eq!(crc32c(&[0u8; 32]), 0x8A91_36AA);
    }

    #[test]
    fn writes_event_files_that_decode_with_valid_crcs() {
        let dir = tempfile::tempdir().unwrap();
        let mut w = TbWriter::new(dir.path().join("tb")).unwrap();
        let first = serde_json::json!({"step": 1, "time": 1_699_999_999.0, "rollout/reward_mean": 0.25});
        w.metrics(1, 1_699_999_999.0, first.as_object().unwrap()).unwrap();
        let mut line = Map::new();
        line.insert("step".into(), 2.into());
        line.insert("time".into(), serde_json::json!(1_700_000_000.5));
        line.insert("update/grad_norm".into(), serde_json::json!(3.5));
        line.insert("alarms".into(), serde_json::json!([]));
        w.metrics(2, 1_700_000_000.5, &line).unwrap();
        let path = w.path().to_path_buf();
        drop(w);
        assert!(path.file_name().unwrap().to_string_lossy().starts_with("events.out.tfevents."));
        let got = read_scalars(&path).unwrap();
        let brief: Vec<(&str, i64, f32)> = got.iter().map(|s| (s.tag.as_str(), s.step, s.value)).collect();
        assert_eq!(brief, vec![("rollout/reward_mean", 1, 0.25), ("update/grad_norm", 2, 3.5)]);
        assert_eq!(got[1].wall_time, 1_700_000_000.5);

        // A flipped bit in the last record's payload is caught by its CRC.
        let mut bytes = std::fs::read(&path).unwrap();
        let n = bytes.len();
        bytes[n - 6] ^= 1;
        std::fs::write(&path, &bytes).unwrap();
        let err = format!("{:#}", read_scalars(&path).unwrap_err());
        assert!(err.contains("bad data crc"), "{err}");
    }

    #[test]
    fn large_steps_round_trip_as_varints() {
        let ev = encode_event(1.0, 300_000, None, &[("a", 1.0)]);
        let mut out = vec![];
        decode_event(&ev, &mut out).unwrap();
        assert_eq!(out[0].step, 300_000);
    }
}
