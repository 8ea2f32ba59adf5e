//! `padding_mask_crop`: inpaint only the masked part of an image, as diffusers' inpainting
//! pipelines do with it. The region holding every nonzero mask pixel, padded and widened to the
//! output's aspect ratio ([`crop_region`], diffusers' `VaeImageProcessor.get_crop_region`), is
//! cut from image and mask and resized to the output size ([`crop_and_fill`], its
//! `resize_mode="fill"`); after decoding, the result is resized back into the region and laid
//! over the original image, blended by the unbinarized mask ([`apply_overlay`]). Host-side
//! 8-bit image work, in Pillow's integer arithmetic.

use image::{DynamicImage, GrayImage, ImageBuffer, Pixel, RgbImage};

use crate::error::{PipelineError, Result};
use crate::image::Images;
use crate::resample::Filter;

/// A rectangle of image pixels, `x1..x2` by `y1..y2` (diffusers' `crops_coords`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CropRegion {
    pub x1: usize,
    pub y1: usize,
    pub x2: usize,
    pub y2: usize,
}

impl CropRegion {
    pub fn width(&self) -> usize {
        self.x2 - self.x1
    }

    pub fn height(&self) -> usize {
        self.y2 - self.y1
    }
}

/// The mask as PIL's `convert("L")` gives it: grayscale as is, color by the integer luma
/// `(19595 R + 38470 G + 7471 B + 2^15) >> 16` (alpha ignored).
pub fn pil_luma(mask: &DynamicImage) -> GrayImage {
    match mask {
        DynamicImage::ImageLuma8(gray) => gray.clone(),
        other => {
            let rgb = other.to_rgb8();
            GrayImage::from_fn(rgb.width(), rgb.height(), |x, y| {
                let [r, g, b] = rgb.get_pixel(x, y).0.map(u32::from);
                image::Luma([((r * 19595 + g * 38470 + b * 7471 + 0x8000) >> 16) as u8])
            })
        }
    }
}

/// diffusers' `get_crop_region(mask, width, height, pad)`: the smallest rectangle holding every
/// nonzero pixel of `mask`, grown by `padding` on each side (within the image), then grown
/// along one axis, as evenly as fits, to the aspect ratio of the `width x height` output. An
/// all-black mask (nothing to repaint) is an error.
pub fn crop_region(
    mask: &DynamicImage,
    width: usize,
    height: usize,
    padding: usize,
) -> Result<CropRegion> {
    let gray = pil_luma(mask);
    let (w, h) = (gray.width() as i64, gray.height() as i64);
    let column_empty = |x: i64| (0..h).all(|y| gray.get_pixel(x as u32, y as u32).0[0] == 0);
    let row_empty = |y: i64| (0..w).all(|x| gray.get_pixel(x as u32, y as u32).0[0] == 0);
    let left = (0..w).take_while(|&x| column_empty(x)).count() as i64;
    if left == w || width == 0 || height == 0 {
        return Err(PipelineError::InvalidInput(
            "padding_mask_crop: the mask is all black, so there is no region to repaint; \
             paint the part to repaint white"
                .into(),
        ));
    }
    let right = (0..w).rev().take_while(|&x| column_empty(x)).count() as i64;
    let top = (0..h).take_while(|&y| row_empty(y)).count() as i64;
    let bottom = (0..h).rev().take_while(|&y| row_empty(y)).count() as i64;
    let pad = padding as i64;
    let (mut x1, mut y1) = ((left - pad).max(0), (top - pad).max(0));
    let (mut x2, mut y2) = ((w - right + pad).min(w), (h - bottom + pad).min(h));
    let ratio_crop = (x2 - x1) as f64 / (y2 - y1) as f64;
    let ratio = width as f64 / height as f64;
    // Python's `int()` truncates (as `as` does), `//` floors (as `div_euclid` by 2 does).
    if ratio_crop > ratio {
        let desired = (x2 - x1) as f64 / ratio;
        let diff = (desired - (y2 - y1) as f64) as i64;
        y1 -= diff.div_euclid(2);
        y2 += diff - diff.div_euclid(2);
        if y2 >= h {
            let over = y2 - h;
            y2 -= over;
            y1 -= over;
        }
        if y1 < 0 {
            y2 -= y1;
            y1 = 0;
        }
        y2 = y2.min(h);
    } else {
        let desired = (y2 - y1) as f64 * ratio;
        let diff = (desired - (x2 - x1) as f64) as i64;
        x1 -= diff.div_euclid(2);
        x2 += diff - diff.div_euclid(2);
        if x2 >= w {
            let over = x2 - w;
            x2 -= over;
            x1 -= over;
        }
        if x1 < 0 {
            x2 -= x1;
            x1 = 0;
        }
        x2 = x2.min(w);
    }
    Ok(CropRegion {
        x1: x1 as usize,
        y1: y1 as usize,
        x2: x2 as usize,
        y2: y2 as usize,
    })
}

/// PIL's resize of `image` to `width x height` with `filter`, of the source box `region`.
fn resize_box<P: Pixel<Subpixel = u8>>(
    image: &ImageBuffer<P, Vec<u8>>,
    filter: Filter,
    (width, height): (usize, usize),
    region: [f64; 4],
) -> ImageBuffer<P, Vec<u8>> {
    let size = (image.width() as usize, image.height() as usize);
    let pixels = crate::resample::resize_box(
        filter,
        image.as_raw(),
        usize::from(P::CHANNEL_COUNT),
        size,
        (width, height),
        region,
    );
    ImageBuffer::from_raw(width as u32, height as u32, pixels).expect("the resampled size")
}

/// PIL's `resize((width, height), LANCZOS)`: a copy when the size is already that.
fn resize<P: Pixel<Subpixel = u8>>(
    image: &ImageBuffer<P, Vec<u8>>,
    (width, height): (usize, usize),
) -> ImageBuffer<P, Vec<u8>> {
    let whole = [
        0.0,
        0.0,
        f64::from(image.width()),
        f64::from(image.height()),
    ];
    resize_box(image, Filter::Lanczos, (width, height), whole)
}

/// PIL's `paste(image, (x, y))`: the part that falls inside `onto`.
fn paste<P: Pixel<Subpixel = u8>>(
    onto: &mut ImageBuffer<P, Vec<u8>>,
    image: &ImageBuffer<P, Vec<u8>>,
    x: i64,
    y: i64,
) {
    for (sx, sy, p) in image.enumerate_pixels() {
        let (tx, ty) = (x + i64::from(sx), y + i64::from(sy));
        if tx >= 0 && ty >= 0 && tx < i64::from(onto.width()) && ty < i64::from(onto.height()) {
            onto.put_pixel(tx as u32, ty as u32, *p);
        }
    }
}

/// `image` cut to `region` and brought to `width x height` as diffusers'
/// `VaeImageProcessor.resize(resize_mode="fill")` does: resized to fit inside, keeping its
/// aspect ratio, centred, and the uncovered rows (or columns) filled with the image's first and
/// last rows stretched (PIL resizes of a zero-height box at either edge, with `Image.resize`'s
/// default bicubic filter, as diffusers leaves it).
pub fn crop_and_fill<P: Pixel<Subpixel = u8> + 'static>(
    image: &ImageBuffer<P, Vec<u8>>,
    region: CropRegion,
    width: usize,
    height: usize,
) -> ImageBuffer<P, Vec<u8>> {
    let cropped = image::imageops::crop_imm(
        image,
        region.x1 as u32,
        region.y1 as u32,
        region.width() as u32,
        region.height() as u32,
    )
    .to_image();
    let (cw, ch) = (region.width(), region.height());
    let ratio = width as f64 / height as f64;
    let src_ratio = cw as f64 / ch as f64;
    let src_w = if ratio < src_ratio {
        width
    } else {
        cw * height / ch
    };
    let src_h = if ratio >= src_ratio {
        height
    } else {
        ch * width / cw
    };
    let resized = resize(&cropped, (src_w, src_h));
    let mut out = ImageBuffer::new(width as u32, height as u32);
    let offset = |full: usize, part: usize| (full / 2) as i64 - (part / 2) as i64;
    paste(
        &mut out,
        &resized,
        offset(width, src_w),
        offset(height, src_h),
    );
    let (rw, rh) = (src_w as f64, src_h as f64);
    if ratio < src_ratio {
        let fill = offset(height, src_h);
        if fill > 0 {
            let size = (width, fill as usize);
            paste(
                &mut out,
                &resize_box(&resized, Filter::Bicubic, size, [0.0, 0.0, rw, 0.0]),
                0,
                0,
            );
            let last = resize_box(&resized, Filter::Bicubic, size, [0.0, rh, rw, rh]);
            paste(&mut out, &last, 0, fill + src_h as i64);
        }
    } else if ratio > src_ratio {
        let fill = offset(width, src_w);
        if fill > 0 {
            let size = (fill as usize, height);
            paste(
                &mut out,
                &resize_box(&resized, Filter::Bicubic, size, [0.0, 0.0, 0.0, rh]),
                0,
                0,
            );
            let last = resize_box(&resized, Filter::Bicubic, size, [rw, 0.0, rw, rh]);
            paste(&mut out, &last, fill + src_w as i64, 0);
        }
    }
    out
}

/// Pillow's `DIV255`: `v / 255` rounded.
fn div255(v: u32) -> u32 {
    let t = v + 128;
    ((t >> 8) + t) >> 8
}

/// diffusers' `apply_overlay(mask, original, generated, crop_coords)`: `generated` resized to
/// cover `region` (PIL's Lanczos, centre-cropped: `resize_mode="crop"`) and placed there on a
/// black image of the original's size, then the original laid over it with opacity
/// `255 - mask` (the mask as PIL's `L`, not binarized), in Pillow's integer arithmetic
/// (premultiplied paste, `RGBa` to `RGBA`, `alpha_composite`).
pub fn apply_overlay(
    mask: &DynamicImage,
    original: &RgbImage,
    generated: &RgbImage,
    region: CropRegion,
) -> RgbImage {
    let (w, h) = (region.width(), region.height());
    let (gw, gh) = (generated.width() as usize, generated.height() as usize);
    let ratio = w as f64 / h as f64;
    let src_ratio = gw as f64 / gh as f64;
    let src_w = if ratio > src_ratio { w } else { gw * h / gh };
    let src_h = if ratio <= src_ratio { h } else { gh * w / gw };
    let resized = resize(generated, (src_w, src_h));
    let mut inner = RgbImage::new(w as u32, h as u32);
    paste(
        &mut inner,
        &resized,
        (w / 2) as i64 - (src_w / 2) as i64,
        (h / 2) as i64 - (src_h / 2) as i64,
    );
    let mut out = RgbImage::new(original.width(), original.height());
    paste(&mut out, &inner, region.x1 as i64, region.y1 as i64);
    let gray = pil_luma(mask);
    for (x, y, pixel) in out.enumerate_pixels_mut() {
        let keep = 255 - u32::from(gray.get_pixel(x, y).0[0]);
        if keep == 0 {
            continue;
        }
        let source = original.get_pixel(x, y).0;
        for (c, dst) in pixel.0.iter_mut().enumerate() {
            // Pasted premultiplied through the inverted mask, then un-premultiplied.
            let premultiplied = div255(u32::from(source[c]) * keep);
            let src = if keep == 255 {
                premultiplied
            } else {
                (255 * premultiplied / keep).min(255)
            };
            // `alpha_composite` over an opaque image, 7 extra bits of precision.
            let mixed = src * keep * 128 + u32::from(*dst) * (255 - keep) * 128 + (0x80 << 7);
            *dst = ((((mixed >> 8) + mixed) >> 8) >> 7).min(255) as u8;
        }
    }
    out
}

/// The inputs of a cropped inpainting run.
pub(crate) struct CroppedInputs {
    pub image: DynamicImage,
    pub mask: DynamicImage,
    pub region: CropRegion,
}

/// Image and mask cut to the crop region of `padding` and filled to `width x height`, as
/// diffusers' inpainting pipelines preprocess them with `padding_mask_crop` (the mask stays
/// grayscale or RGB as given; it is binarized later, as without a crop).
pub(crate) fn crop_inputs(
    image: &DynamicImage,
    mask: &DynamicImage,
    (width, height): (usize, usize),
    padding: usize,
) -> Result<CroppedInputs> {
    let region = crop_region(mask, width, height, padding)?;
    let image = DynamicImage::ImageRgb8(crop_and_fill(&image.to_rgb8(), region, width, height));
    let mask = match mask {
        DynamicImage::ImageLuma8(gray) => {
            DynamicImage::ImageLuma8(crop_and_fill(gray, region, width, height))
        }
        other => DynamicImage::ImageRgb8(crop_and_fill(&other.to_rgb8(), region, width, height)),
    };
    Ok(CroppedInputs {
        image,
        mask,
        region,
    })
}

/// Every image of `images` laid over `original` in `region` ([`apply_overlay`]): images of the
/// original's size.
pub(crate) fn paste_back(
    images: Images,
    mask: &DynamicImage,
    original: &DynamicImage,
    region: CropRegion,
) -> Result<Images> {
    let original = original.to_rgb8();
    let mut data = Vec::new();
    for i in 0..images.count {
        let generated = images.to_rgb8(i).ok_or_else(|| {
            PipelineError::InvalidInput("an image of the batch is missing".into())
        })?;
        let overlaid = apply_overlay(mask, &original, &generated, region);
        data.extend(overlaid.as_raw().iter().map(|&v| f32::from(v) / 255.0));
    }
    Ok(Images {
        count: images.count,
        height: original.height() as usize,
        width: original.width() as usize,
        data,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    fn mask(size: (u32, u32), rect: (u32, u32, u32, u32)) -> DynamicImage {
        DynamicImage::ImageLuma8(GrayImage::from_fn(size.0, size.1, |x, y| {
            let inside = x >= rect.0 && x < rect.2 && y >= rect.1 && y < rect.3;
            image::Luma([if inside { 255 } else { 0 }])
        }))
    }

    #[test]
    fn crop_region_pads_and_widens_to_the_output_ratio_as_diffusers() {
        // diffusers' get_crop_region gives the same three regions: the 24x10 box at (10, 20)
        // padded by 4 is 32x18; for a square output it grows to 32 rows, 7 above and 7 below.
        let m = mask((64, 64), (10, 20, 34, 30));
        let r = crop_region(&m, 64, 64, 4).unwrap();
        assert_eq!((r.x1, r.y1, r.x2, r.y2), (6, 9, 38, 41));
        // Against the bottom edge: shifted up to fit.
        let m = mask((64, 64), (10, 56, 40, 64));
        let r = crop_region(&m, 64, 64, 0).unwrap();
        assert_eq!((r.x1, r.y1, r.x2, r.y2), (10, 34, 40, 64));
        // Taller than wide for a wide output: columns added.
        let m = mask((64, 64), (30, 0, 34, 64));
        let r = crop_region(&m, 64, 32, 0).unwrap();
        assert_eq!((r.width(), r.height()), (64, 64));
        let err = crop_region(&mask((8, 8), (0, 0, 0, 0)), 8, 8, 2).unwrap_err();
        assert!(err.to_string().contains("all black"), "{err}");
    }

    #[test]
    fn overlay_keeps_the_original_where_the_mask_is_black() {
        let original = RgbImage::from_fn(16, 16, |x, y| image::Rgb([x as u8 * 9, y as u8 * 7, 50]));
        let generated = RgbImage::from_pixel(16, 16, image::Rgb([200, 10, 100]));
        let m = mask((16, 16), (4, 4, 12, 12));
        let region = crop_region(&m, 16, 16, 0).unwrap();
        let out = apply_overlay(&m, &original, &generated, region);
        assert_eq!(out.get_pixel(0, 0), original.get_pixel(0, 0));
        assert_eq!(out.get_pixel(15, 3), original.get_pixel(15, 3));
        assert_eq!(out.get_pixel(8, 8).0, [200, 10, 100]);
    }
}
