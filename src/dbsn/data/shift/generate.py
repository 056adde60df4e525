"""The generator of a CIFAR-10-C / CIFAR-100-C stand-in, for when the published files cannot be had.

`corrupt` applies the corruptions with the CIFAR severity parameters of the original generation
script (Hendrycks' make_cifar_c.py); `write_generated_set` (or ``python -m dbsn.data.shift``)
writes them in the published layout plus a `MARKER` file, so that every result computed from it
can say it came from generated data (`is_generated`). It is not the published data: other
random draws, motion blur and snow without ImageMagick (an own line kernel), no frost and no
spatter (see `NOT_GENERATED`).

Where the original script's code and its description differ, the generator follows the code,
because the code made the published files: glass blur's "swap" copies (the two numpy row views
make it ``x[h, w] = x[h', w']``), its scan starts at row/column ``32 - delta``, and zoom blur's
``np.arange(1, 1.06, 0.01)`` includes 1.06 (and 1.11 for severity 2). Results are stored the
way the script stores them: clipped to [0, 1], times 255, truncated to uint8; motion blur's
(and snow's blurred layer) as ImageMagick writes them, truncated too (`_imagemagick_8bit`).
"""

import io
import json
import math
import os
import time
from collections.abc import Callable, Sequence
from pathlib import Path

import numpy as np
from PIL import Image
from scipy import ndimage
from torch import Tensor

from dbsn.data.shift.published import (
    ALL_CORRUPTIONS,
    CORRUPTIONS,
    IMAGE_SIZE,
    MARKER,
    PUBLISHED,
    SEVERITIES,
    _check_corruption,
    _check_severity,
    is_generated,
)

#: Corruptions that `corrupt` cannot make, and why.
NOT_GENERATED = {
    "frost": "frost blends each image with crops of six frost photographs that ship with the "
    "original script and nowhere else; without them it cannot be reproduced",
    "spatter": "spatter's liquid layers (severities 1-3) rest on OpenCV's Canny edges, distance "
    "transform and histogram equalisation, which this generator does not reimplement faithfully",
}
#: Corruptions that `corrupt` makes, in the published order.
GENERATED_CORRUPTIONS = tuple(name for name in ALL_CORRUPTIONS if name not in NOT_GENERATED)
GENERATED_STANDARD = tuple(name for name in CORRUPTIONS if name in GENERATED_CORRUPTIONS)  # the 15 less frost

#: Bumped whenever a change to the generator changes its output for the same seed. 2: motion blur
#: and snow's blurred layer stored as ImageMagick stores them, truncated (`_imagemagick_8bit`),
#: where version 1 rounded.
GENERATOR_VERSION = 2
#: `write_generated_set` corrupts this many images at a time (bounds memory; the random draws,
#: and so the output for a seed, depend on it).
CHUNK = 1000

# CIFAR severity parameters of the original script (make_cifar_c.py), severities 1..5. They differ
# from ImageNet-C's.
PARAMETERS: dict[str, tuple] = {
    "gaussian_noise": (0.04, 0.06, 0.08, 0.09, 0.10),  # noise std
    "shot_noise": (500, 250, 100, 75, 50),  # photons per unit intensity
    "impulse_noise": (0.01, 0.02, 0.03, 0.05, 0.07),  # fraction of values set to 0 or 1
    "speckle_noise": (0.06, 0.10, 0.12, 0.16, 0.20),  # multiplicative noise std
    "gaussian_blur": (0.4, 0.6, 0.7, 0.8, 1.0),  # sigma
    "glass_blur": ((0.05, 1, 1), (0.25, 1, 1), (0.4, 1, 1), (0.25, 1, 2), (0.4, 1, 2)),  # sigma, delta, iter.
    "defocus_blur": ((0.3, 0.4), (0.4, 0.5), (0.5, 0.6), (1, 0.2), (1.5, 0.1)),  # disk radius, alias blur
    "motion_blur": ((6, 1), (6, 1.5), (6, 2), (8, 2), (9, 2.5)),  # radius, sigma
    "zoom_blur": (1.06, 1.11, 1.16, 1.21, 1.26),  # np.arange(1, end, 0.01) zoom factors
    "snow": (  # loc, scale, zoom, threshold, blur radius, blur sigma, mix
        (0.1, 0.2, 1, 0.6, 8, 3, 0.95),
        (0.1, 0.2, 1, 0.5, 10, 4, 0.9),
        (0.15, 0.3, 1.75, 0.55, 10, 4, 0.9),
        (0.25, 0.3, 2.25, 0.6, 12, 6, 0.85),
        (0.3, 0.3, 1.25, 0.65, 14, 12, 0.8),
    ),
    "fog": ((0.2, 3), (0.5, 3), (0.75, 2.5), (1, 2), (1.5, 1.75)),  # strength, wibble decay
    "brightness": (0.05, 0.1, 0.15, 0.2, 0.3),  # added to V in HSV
    "saturate": ((0.3, 0), (0.1, 0), (1.5, 0), (2, 0.1), (2.5, 0.2)),  # S * a + b in HSV
    "contrast": (0.75, 0.5, 0.4, 0.3, 0.15),  # factor on the deviation from the mean
    "elastic_transform": tuple(  # alpha, sigma, affine shift (fractions of the image size)
        (IMAGE_SIZE * a, IMAGE_SIZE * s, IMAGE_SIZE * f)
        for a, s, f in ((0, 0, 0.08), (0.05, 0.2, 0.07), (0.08, 0.06, 0.06), (0.1, 0.04, 0.05), (0.1, 0.03, 0.03))
    ),
    "pixelate": (0.95, 0.9, 0.85, 0.75, 0.65),  # downscaling factor
    "jpeg_compression": (80, 65, 58, 50, 40),  # quality
}


def corrupt(images: np.ndarray | Tensor, corruption: str, severity: int, rng: np.random.Generator) -> np.ndarray:
    """The uint8 images (N, 3, 32, 32), NCHW as this project holds them, under `corruption` at
    `severity`, as uint8 (N, 3, 32, 32).

    All random draws come from `rng`, so a seeded generator gives the same output every time.
    Whole batches are processed at once except pixelate and JPEG (Pillow, one image at a time).
    Raises ValueError for frost and spatter (see `NOT_GENERATED`).
    """
    _check_corruption(corruption)
    _check_severity(severity)
    if corruption in NOT_GENERATED:
        raise ValueError(
            f"{corruption} cannot be generated: {NOT_GENERATED[corruption]}. "
            f"Use the published files ({', '.join(s.url for s in PUBLISHED.values())})."
        )
    x = np.asarray(images)
    if x.dtype != np.uint8 or x.ndim != 4 or x.shape[1:] != (3, IMAGE_SIZE, IMAGE_SIZE):
        raise ValueError(f"images must be uint8 (N, 3, 32, 32), got {x.dtype} {x.shape}")
    if len(x) == 0:
        return x.copy()
    hwc = np.ascontiguousarray(x.transpose(0, 2, 3, 1))  # the original works on HWC images
    out = _GENERATORS[corruption](hwc, PARAMETERS[corruption][severity - 1], rng)
    return np.ascontiguousarray(out.transpose(0, 3, 1, 2))


def _unit(images: np.ndarray, dtype=np.float64) -> np.ndarray:
    return images.astype(dtype) / 255.0


def _stored(x: np.ndarray) -> np.ndarray:
    """[0, 1] floats -> uint8 as the original stores them: clipped, x255, truncated (np.uint8)."""
    return (np.clip(x, 0, 1) * 255).astype(np.uint8)


def _gaussian(x: np.ndarray, sigma: float, mode: str = "nearest", truncate: float = 4.0) -> np.ndarray:
    """Gaussian blur of (N, H, W, C) over H and W (scikit-image's `gaussian` on each image)."""
    return ndimage.gaussian_filter(x, (0, sigma, sigma, 0), mode=mode, truncate=truncate)


def _gaussian_noise(x, c, rng):
    x = _unit(x)
    return _stored(x + rng.normal(0, c, x.shape))


def _shot_noise(x, c, rng):
    return _stored(rng.poisson(_unit(x) * c) / c)


def _impulse_noise(x, c, rng):
    """Salt and pepper: each value (pixel and channel) flipped with probability c, to 1 or 0 with
    equal odds (scikit-image's random_noise, mode 's&p')."""
    x = _unit(x)
    flipped = rng.random(x.shape) < c
    salted = rng.random(x.shape) < 0.5
    x[flipped & salted] = 1
    x[flipped & ~salted] = 0
    return _stored(x)


def _speckle_noise(x, c, rng):
    x = _unit(x)
    return _stored(x + x * rng.normal(0, c, x.shape))


def _gaussian_blur(x, sigma, rng):
    return _stored(_gaussian(_unit(x), sigma))


def _glass_blur(x, c, rng):
    """Blur, then move each pixel's value from a random neighbour, then blur again.

    The original scans rows h and columns w from 32 - delta down to delta + 1 and does
    ``x[h, w], x[h', w'] = x[h', w'], x[h, w]`` on numpy row views, which copies x[h', w'] into
    x[h, w] and leaves x[h', w'] as it was. With delta = 1 (every CIFAR severity) the offsets are
    -1 or 0, so (h', w') is never a pixel this scan has already written: one pass equals one
    gather from the pass's input, done here for the whole batch at once.
    """
    sigma, delta, iterations = c
    assert delta == 1, "the one-gather form of the scan holds for delta = 1 only"
    x = (_gaussian(_unit(x), sigma) * 255).astype(np.uint8)
    scan = np.arange(IMAGE_SIZE - delta, delta, -1)
    n, rows, cols = len(x), scan[:, None], scan[None, :]
    batch = np.arange(n)[:, None, None]
    for _ in range(iterations):
        dy, dx = rng.integers(-delta, delta, size=(2, n, len(scan), len(scan)))
        x[:, rows, cols] = x[batch, rows + dy, cols + dx]  # the right side is gathered before the write
    return _stored(_gaussian(x / 255.0, sigma))


def _disk(radius: float, alias_blur: float) -> np.ndarray:
    """The defocus kernel: a normalised disk on the grid -8..8, blurred by a 3x3 Gaussian of
    sigma `alias_blur` (OpenCV's GaussianBlur), cropped to its non-zero support."""
    grid = np.arange(-8, 9)
    xx, yy = np.meshgrid(grid, grid)
    disk = (xx**2 + yy**2 <= radius**2).astype(np.float32)
    disk /= disk.sum()
    g = np.exp(-(np.arange(-1, 2) ** 2) / (2 * alias_blur**2))
    g /= g.sum()
    disk = ndimage.correlate(disk, np.outer(g, g).astype(np.float32), mode="mirror")
    reach = int(np.abs(np.argwhere(disk > 0) - 8).max())
    return disk[8 - reach : 9 + reach, 8 - reach : 9 + reach]


def _defocus_blur(x, c, rng):
    kernel = _disk(*c).astype(np.float64)
    # OpenCV's filter2D: correlation with a reflect-101 border (scipy's "mirror").
    return _stored(ndimage.correlate(_unit(x), kernel[None, :, :, None], mode="mirror"))


def _motion_kernel_blur(x: np.ndarray, radius: float, sigma: float, angles: np.ndarray) -> np.ndarray:
    """ImageMagick's MotionBlurImage, one angle (degrees) per image, on float (N, H, W, C).

    A one-sided line kernel: 2*ceil(radius)+1 taps i = 0, 1, ..., weights proportional to
    exp(-i^2 / (2 sigma^2)), tap i reading the pixel at (row + round(i sin angle), column +
    round(i cos angle)), edge pixels repeated outside the image. Own code, no ImageMagick: the
    taps and weights are ImageMagick's, the conversion of the result to 8 bits is the caller's
    (`_imagemagick_8bit`).
    """
    width = int(2 * math.ceil(radius) + 1)
    taps = np.arange(width)
    weights = np.exp(-(taps**2) / (2.0 * sigma**2))
    weights /= weights.sum()
    theta = np.pi * np.asarray(angles, dtype=np.float64) / 180.0
    point_x, point_y = width * np.sin(theta), width * np.cos(theta)
    length = np.hypot(point_x, point_y)
    col_offsets = np.ceil(taps[:, None] * point_y / length - 0.5).astype(np.int64)  # (width, N)
    row_offsets = np.ceil(taps[:, None] * point_x / length - 0.5).astype(np.int64)
    n, h, w = x.shape[:3]
    batch, rows, cols = np.arange(n)[:, None, None], np.arange(h)[None, :, None], np.arange(w)[None, None, :]
    out = np.zeros(x.shape, dtype=np.float64)
    for weight, dr, dc in zip(weights, row_offsets, col_offsets):
        r = np.clip(rows + dr[:, None, None], 0, h - 1)
        cc = np.clip(cols + dc[:, None, None], 0, w - 1)
        out += weight * x[batch, r, cc]
    return out


def _motion_blur(x, c, rng):
    radius, sigma = c
    blurred = _motion_kernel_blur(x.astype(np.float64), radius, sigma, rng.uniform(-45, 45, len(x)))
    return _imagemagick_8bit(blurred)  # the original stores the 8-bit PNG ImageMagick writes


def _imagemagick_8bit(blurred: np.ndarray) -> np.ndarray:
    """Blurred 8-bit-scale floats as uint8, the way ImageMagick writes them to an 8-bit PNG:
    held as a 16-bit quantum (value x 257, rounded), then brought to 8 bits by TRUNCATION.

    The original script blurs through Wand (ImageMagick's MotionBlurImage) and keeps the PNG it
    writes. This is a floor of the value, clipped to [0, 255], except within 0.5/257 below the next
    level, which the 16-bit quantum carries up to it: a value that is an integer in exact
    arithmetic (a flat region: 255 comes out of the float sum as 254.99999999999994) keeps it,
    where a plain floor would take a level off. Checked against Wand's motion_blur (ImageMagick
    6.9.11 Q16), it gives the same value for every pixel of random and photo 32x32 images, RGB
    and grey (tests/data/shift/test_generate.py::test_motion_blur_matches_imagemagick).
    """
    quantum = np.floor(np.clip(blurred, 0, 255) * 257 + 0.5)
    return (quantum // 257).astype(np.uint8)


def _interpolation_matrix(n_in: int, n_out: int) -> np.ndarray:
    """(n_out, n_in) weights of order-1 resampling from n_in to n_out points with the end
    points aligned (scipy.ndimage.zoom's default grid)."""
    coords = np.arange(n_out) * ((n_in - 1) / (n_out - 1))
    low = np.minimum(np.floor(coords).astype(np.int64), n_in - 1)
    frac = coords - low
    matrix = np.zeros((n_out, n_in))
    np.add.at(matrix, (np.arange(n_out), low), 1 - frac)
    np.add.at(matrix, (np.arange(n_out), np.minimum(low + 1, n_in - 1)), frac)
    return matrix


def _clipped_zoom(x: np.ndarray, zoom: float) -> np.ndarray:
    """Zoom into the centre of (N, H, H, C) images: crop ceil(H / zoom) pixels from (H - crop)//2,
    resize by `zoom` with order-1 interpolation (scipy.ndimage.zoom: round(crop * zoom) pixels),
    keep H pixels from (size - H)//2. Done as two matrix products over the whole batch."""
    h = x.shape[1]
    crop = int(np.ceil(h / zoom))
    top = (h - crop) // 2
    size = round(crop * zoom)  # Python's round, as scipy.ndimage.zoom sizes its output
    trim = (size - h) // 2
    matrix = _interpolation_matrix(crop, size)[trim : trim + h].astype(x.dtype)
    patch = x[:, top : top + crop, top : top + crop].transpose(0, 3, 1, 2)  # (N, C, crop, crop)
    return (matrix @ patch @ matrix.T).transpose(0, 2, 3, 1)


def _zoom_blur(x, end, rng):
    x = _unit(x, np.float32)
    zooms = np.arange(1, end, 0.01)  # as the original; float steps put 1.06 and 1.11 in for severities 1, 2
    out = np.zeros_like(x)
    for zoom in zooms:
        out += _clipped_zoom(x, zoom)
    return _stored((x + out) / (len(zooms) + 1))


def _snow(x, c, rng):
    loc, scale, zoom, threshold, radius, sigma, mix = c
    x = _unit(x, np.float32)
    n = len(x)
    layer = _clipped_zoom(rng.normal(loc, scale, size=(n, IMAGE_SIZE, IMAGE_SIZE, 1)), zoom)
    layer[layer < threshold] = 0
    layer = (np.clip(layer, 0, 1) * 255).astype(np.uint8)  # the original blurs it as an 8-bit grey image
    # The original blurs it with ImageMagick, which writes the 8-bit grey PNG truncated (as motion blur).
    layer = _imagemagick_8bit(_motion_kernel_blur(layer.astype(np.float64), radius, sigma, rng.uniform(-135, -45, n)))
    layer = layer / 255
    gray = (x @ np.array([0.299, 0.587, 0.114], dtype=np.float32))[..., None]
    x = mix * x + (1 - mix) * np.maximum(x, gray * 1.5 + 0.5)
    return _stored(x + layer + layer[:, ::-1, ::-1])


def _plasma_fractal(n: int, decay: float, rng: np.random.Generator, size: int = IMAGE_SIZE) -> np.ndarray:
    """n diamond-square height maps (n, size, size) in [0, 1] (the original's plasma_fractal,
    for a batch): each step sets the new points to the mean of their neighbours plus uniform
    noise of amplitude wibble^2, and wibble shrinks by `decay` per step."""
    grid = np.zeros((n, size, size))
    step, wibble = size, 100.0

    def wibbled_mean(total):
        return total / 4 + wibble * rng.uniform(-wibble, wibble, total.shape)

    while step >= 2:
        half = step // 2
        corners = grid[:, ::step, ::step]
        squares = corners + np.roll(corners, -1, axis=1)
        squares = squares + np.roll(squares, -1, axis=2)
        grid[:, half::step, half::step] = wibbled_mean(squares)
        centres, corners = grid[:, half::step, half::step], grid[:, ::step, ::step]
        left = centres + np.roll(centres, 1, axis=1) + corners + np.roll(corners, -1, axis=2)
        grid[:, ::step, half::step] = wibbled_mean(left)
        top = centres + np.roll(centres, 1, axis=2) + corners + np.roll(corners, -1, axis=1)
        grid[:, half::step, ::step] = wibbled_mean(top)
        step //= 2
        wibble /= decay
    grid -= grid.min(axis=(1, 2), keepdims=True)
    return grid / grid.max(axis=(1, 2), keepdims=True)


def _fog(x, c, rng):
    strength, decay = c
    x = _unit(x)
    peak = x.max(axis=(1, 2, 3), keepdims=True)
    x = x + strength * _plasma_fractal(len(x), decay, rng)[..., None]
    return _stored(x * peak / (peak + strength))


def _rgb_to_hsv(rgb: np.ndarray) -> np.ndarray:
    """HSV of RGB in [0, 1] on the last axis (scikit-image's rgb2hsv)."""
    v = rgb.max(-1)
    delta = v - rgb.min(-1)
    safe = np.where(delta == 0, 1, delta)
    s = np.where(delta == 0, 0, delta / np.where(v == 0, 1, v))
    r, g, b = rgb[..., 0], rgb[..., 1], rgb[..., 2]
    h = np.where(r == v, (g - b) / safe, 0.0)
    h = np.where(g == v, 2 + (b - r) / safe, h)
    h = np.where(b == v, 4 + (r - g) / safe, h)
    h = np.where(delta == 0, 0, (h / 6) % 1)
    return np.stack([h, s, v], axis=-1)


def _hsv_to_rgb(hsv: np.ndarray) -> np.ndarray:
    """RGB of HSV on the last axis (scikit-image's hsv2rgb)."""
    h, s, v = hsv[..., 0], hsv[..., 1], hsv[..., 2]
    sector = np.floor(h * 6)
    f = h * 6 - sector
    p, q, t = v * (1 - s), v * (1 - f * s), v * (1 - (1 - f) * s)
    sector = sector.astype(np.int64) % 6
    table = np.stack([
        np.stack([v, t, p], -1), np.stack([q, v, p], -1), np.stack([p, v, t], -1),
        np.stack([p, q, v], -1), np.stack([t, p, v], -1), np.stack([v, p, q], -1),
    ])  # fmt: skip
    return np.take_along_axis(table, sector[None, ..., None], axis=0)[0]


def _brightness(x, c, rng):
    hsv = _rgb_to_hsv(_unit(x))
    hsv[..., 2] = np.clip(hsv[..., 2] + c, 0, 1)
    return _stored(_hsv_to_rgb(hsv))


def _saturate(x, c, rng):
    scale, shift = c
    hsv = _rgb_to_hsv(_unit(x))
    hsv[..., 1] = np.clip(hsv[..., 1] * scale + shift, 0, 1)
    return _stored(_hsv_to_rgb(hsv))


def _contrast(x, c, rng):
    x = _unit(x)
    means = x.mean(axis=(1, 2), keepdims=True)
    return _stored((x - means) * c + means)


def _border_index(index: np.ndarray, n: int, mode: str) -> np.ndarray:
    """Indices outside 0..n-1 folded back: "reflect" repeats the edge pixel (d c b a | a b c d,
    scipy's reflect), "mirror" does not (d c b | a b c d, OpenCV's reflect-101)."""
    if mode == "reflect":
        index = np.mod(index, 2 * n)
        return np.where(index >= n, 2 * n - 1 - index, index)
    index = np.mod(index, 2 * n - 2)
    return np.where(index >= n, 2 * n - 2 - index, index)


def _bilinear(x: np.ndarray, rows: np.ndarray, cols: np.ndarray, mode: str) -> np.ndarray:
    """(N, H, W, C) images sampled at float (rows, cols), each (N, H, W), with order-1
    interpolation; neighbours outside the image folded back by `_border_index`."""
    n, h, w = x.shape[:3]
    batch = np.arange(n)[:, None, None]
    r0, c0 = np.floor(rows), np.floor(cols)
    fr, fc = (rows - r0)[..., None], (cols - c0)[..., None]
    r0, c0 = r0.astype(np.int64), c0.astype(np.int64)
    r = [_border_index(r0, h, mode), _border_index(r0 + 1, h, mode)]
    c = [_border_index(c0, w, mode), _border_index(c0 + 1, w, mode)]
    return ((1 - fr) * ((1 - fc) * x[batch, r[0], c[0]] + fc * x[batch, r[0], c[1]])
            + fr * ((1 - fc) * x[batch, r[1], c[0]] + fc * x[batch, r[1], c[1]]))  # fmt: skip


def _elastic_transform(x, c, rng):
    """A random affine warp (three points moved by up to `shift` pixels; OpenCV's warpAffine with a
    reflect-101 border), then a smooth random displacement field (uniform noise blurred by a
    Gaussian of `sigma`, times `alpha`; scipy's map_coordinates with its reflect border), both
    order-1. OpenCV rounds warp coordinates to 1/32 pixel; this does not."""
    alpha, sigma, shift = c
    x = _unit(x, np.float32)
    n, size = len(x), IMAGE_SIZE
    centre, reach = size // 2, size // 3
    source = np.array([[centre + reach, centre + reach], [centre + reach, centre - reach], [centre - reach] * 2], float)
    target = source + rng.uniform(-shift, shift, size=(n, 3, 2)).astype(np.float32)
    # The affine map taking `source` to `target`; each output pixel reads the inverse image point,
    # i.e. the affine map taking `target` to `source`, solved from the three pairs. Points are (x, y).
    inverse = np.linalg.solve(np.concatenate([target, np.ones((n, 3, 1))], axis=2), np.broadcast_to(source, (n, 3, 2)))
    yy, xx = np.mgrid[0:size, 0:size]
    pixels = np.stack([xx, yy, np.ones_like(xx)], axis=-1).astype(float)  # (H, W, 3) as (x, y, 1)
    read = np.einsum("hwk,nkj->nhwj", pixels, inverse)
    x = _bilinear(x, read[..., 1], read[..., 0], mode="mirror").astype(np.float32)

    def field():
        noise = rng.uniform(-1, 1, size=(n, size, size))
        smooth = ndimage.gaussian_filter(noise, (0, sigma, sigma), mode="reflect", truncate=3)
        return (smooth * alpha).astype(np.float32)

    dx, dy = field(), field()
    return _stored(_bilinear(x, yy + dy, xx + dx, mode="reflect"))


def _per_image(transform: Callable[[Image.Image], Image.Image], x: np.ndarray) -> np.ndarray:
    out = np.empty_like(x)
    for i, image in enumerate(x):
        out[i] = np.asarray(transform(Image.fromarray(image)).convert("RGB"))
    return out


def _pixelate(x, c, rng):
    size = int(IMAGE_SIZE * c)
    box = Image.Resampling.BOX
    return _per_image(lambda im: im.resize((size, size), box).resize((IMAGE_SIZE, IMAGE_SIZE), box), x)


def _jpeg(image: Image.Image, quality: int) -> Image.Image:
    buffer = io.BytesIO()
    image.save(buffer, "JPEG", quality=quality)
    return Image.open(buffer)


def _jpeg_compression(x, quality, rng):
    return _per_image(lambda im: _jpeg(im, quality), x)


# Each takes uint8 (N, 32, 32, 3), one severity's parameters and the generator; returns uint8 HWC.
_GENERATORS: dict[str, Callable[[np.ndarray, object, np.random.Generator], np.ndarray]] = {
    "gaussian_noise": _gaussian_noise,
    "shot_noise": _shot_noise,
    "impulse_noise": _impulse_noise,
    "defocus_blur": _defocus_blur,
    "glass_blur": _glass_blur,
    "motion_blur": _motion_blur,
    "zoom_blur": _zoom_blur,
    "snow": _snow,
    "fog": _fog,
    "brightness": _brightness,
    "contrast": _contrast,
    "elastic_transform": _elastic_transform,
    "pixelate": _pixelate,
    "jpeg_compression": _jpeg_compression,
    "speckle_noise": _speckle_noise,
    "gaussian_blur": _gaussian_blur,
    "saturate": _saturate,
}
assert set(_GENERATORS) == set(GENERATED_CORRUPTIONS)


# ----- writing a generated set -----------------------------------------------------------------
def severity_rng(seed: int, corruption: str, severity: int) -> np.random.Generator:
    """The generator of one (corruption, severity) block: it depends on nothing else, so a block
    is the same whichever other corruptions are generated with it."""
    return np.random.default_rng([seed, ALL_CORRUPTIONS.index(corruption), severity])


def write_generated_set(
    folder: str | Path,
    images: np.ndarray | Tensor,
    labels: np.ndarray | Tensor,
    corruptions: Sequence[str] = GENERATED_CORRUPTIONS,
    seed: int = 0,
    source: str = "",
    log: Callable[[str], None] | None = None,
) -> Path:
    """Corrupt uint8 images (N, 3, 32, 32) at every severity and write them in the published
    layout: ``<corruption>.npy`` uint8 (5N, 32, 32, 3) HWC, ``labels.npy`` uint8 (5N,), plus
    `MARKER`, which says the set is generated (with the generator's version, the seed, the
    corruptions and `source`, e.g. which clean test set).

    The marker is written before any array, and each array under a temporary name then renamed,
    so an interrupted run leaves a folder that still reads as generated and no half-written
    file. Refuses a folder holding corruption files without the marker (published files).
    """
    folder = Path(folder)
    images, labels = np.asarray(images), np.asarray(labels)
    if images.dtype != np.uint8 or images.ndim != 4 or images.shape[1:] != (3, IMAGE_SIZE, IMAGE_SIZE):
        raise ValueError(f"images must be uint8 (N, 3, 32, 32), got {images.dtype} {images.shape}")
    if labels.shape != (len(images),) or not np.issubdtype(labels.dtype, np.integer):
        raise ValueError(f"labels must be integers of shape ({len(images)},), got {labels.dtype} {labels.shape}")
    if len(labels) and (labels.min() < 0 or labels.max() > 255):
        raise ValueError("labels must lie in 0..255 (stored as uint8, as the published labels.npy)")
    for name in corruptions:
        corrupt(images[:0], name, 1, np.random.default_rng())  # unknown names, frost, spatter: fail now
    if not isinstance(seed, int) or seed < 0:
        raise ValueError(f"seed must be an int >= 0, got {seed!r}")
    present = [f"{name}.npy" for name in ("labels",) + ALL_CORRUPTIONS if (folder / f"{name}.npy").exists()]
    if present and not is_generated(folder):
        raise FileExistsError(
            f"{folder} holds {', '.join(present)} but no {MARKER}: it looks like published files; "
            "write the generated set to another folder"
        )
    folder.mkdir(parents=True, exist_ok=True)
    marker = {
        "generated": True,
        "note": "generated by dbsn.data.shift, not the published CIFAR-C files: other random draws, "
        "motion blur and snow without ImageMagick; frost and spatter not generated",
        "generator": "dbsn.data.shift",
        "generator_version": GENERATOR_VERSION,
        "seed": seed,
        "chunk": CHUNK,
        "corruptions": list(corruptions),
        "severities": list(SEVERITIES),
        "images_per_severity": len(images),
        "source": source,
        "not_generated": NOT_GENERATED,
    }
    (folder / MARKER).write_text(json.dumps(marker, indent=2) + "\n")
    _save(folder / "labels.npy", np.tile(labels.astype(np.uint8), len(SEVERITIES)))
    n = len(images)
    for name in corruptions:
        start = time.perf_counter()
        partial = folder / f"{name}.npy.partial"
        out = np.lib.format.open_memmap(partial, mode="w+", dtype=np.uint8, shape=(len(SEVERITIES) * n, 32, 32, 3))
        for severity in SEVERITIES:
            rng = severity_rng(seed, name, severity)
            for begin in range(0, n, CHUNK):
                block = corrupt(images[begin : begin + CHUNK], name, severity, rng)
                out[(severity - 1) * n + begin : (severity - 1) * n + begin + len(block)] = block.transpose(0, 2, 3, 1)
        out.flush()
        del out
        os.replace(partial, folder / f"{name}.npy")
        if log:
            log(f"{name}: {len(SEVERITIES) * n} images in {time.perf_counter() - start:.1f} s")
    return folder


def _save(path: Path, array: np.ndarray) -> None:
    partial = path.with_name(path.name + ".partial")
    with open(partial, "wb") as f:
        np.save(f, array)
    os.replace(partial, path)
