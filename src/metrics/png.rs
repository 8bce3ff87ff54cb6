//! A minimal PNG encoder for 8-bit RGB buffers (the plots' bitmap backend draws into one).
//!
//! PNG = signature, IHDR, IDAT (zlib of each row prefixed by filter byte 0), IEND; every chunk is
//! `length, type, data, crc32(type+data)`. flate2 and crc32fast were already in the build, so this
//! avoids the `image` crate and its decoders.
use anyhow::{ensure, Result};
use std::io::Write;

fn chunk(out: &mut Vec<u8>, kind: &[u8; 4], data: &[u8]) {
    out.extend_from_slice(&(data.len() as u32).to_be_bytes());
    let mut crc = crc32fast::Hasher::new();
    crc.update(kind);
    crc.update(data);
    out.extend_from_slice(kind);
    out.extend_from_slice(data);
    out.extend_from_slice(&crc.finalize().to_be_bytes());
}

/// Encodes `rgb` (row-major, 3 bytes per pixel) as a PNG file's bytes.
pub fn encode_rgb(width: u32, height: u32, rgb: &[u8]) -> Result<Vec<u8>> {
    let row = width as usize * 3;
    ensure!(rgb.len() == row * height as usize, "png: {} bytes for a {width}x{height} RGB image", rgb.len());
    let mut ihdr = Vec::with_capacity(13);
    ihdr.extend_from_slice(&width.to_be_bytes());
    ihdr.extend_from_slice(&height.to_be_bytes());
    ihdr.extend_from_slice(&[8, 2, 0, 0, 0]); // 8-bit depth, truecolour, deflate, no filter, no interlace
    let mut z = flate2::write::ZlibEncoder::new(Vec::new(), flate2::Compression::default());
    for line in rgb.chunks(row) {
        z.write_all(&[0])?; // filter: none (plots are flat colour; deflate does the work)
        z.write_all(line)?;
    }
    let idat = z.finish()?;
    let mut out = b"\x89PNG\r\n\x1a\n".to_vec();
    chunk(&mut out, b"IHDR", &ihdr);
    chunk(&mut out, b"IDAT", &idat);
    chunk(&mut out, b"IEND", &[]);
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::io::Read;

    #[test]
    fn encodes_a_two_by_two_image_that_inflates_back() {
        let px = [255, 0, 0, 0, 255, 0, 0, 0, 255, 255, 255, 255];
        let png = encode_rgb(2, 2, &px).unwrap();
        assert_eq!(&png[..8], b"\x89PNG\r\n\x1a\n");
        assert_eq!(&png[12..16], b"IHDR");
        // IHDR's CRC as computed by zlib for this header (2x2, RGB8).
        assert_eq!(&png[29..33], &crc32fast::hash(&png[12..29]).to_be_bytes());
        let idat_len = u32::from_be_bytes(png[33..37].try_into().unwrap()) as usize;
        assert_eq!(&png[37..41], b"IDAT");
        let mut raw = vec![];
        flate2::read::ZlibDecoder::new(&png[41..41 + idat_len]).read_to_end(&mut raw).unwrap();
        assert_eq!(raw, [&[0][..], &px[..6], &[0], &px[6..]].concat());
        assert!(png.ends_with(&[0, 0, 0, 0, b'I', b'E', b'N', b'D', 0xAE, 0x42, 0x60, 0x82]));
        assert!(encode_rgb(3, 2, &px).is_err());
    }
}
