"""The CIFAR-10-C / CIFAR-100-C generator (dbsn.data.shift.generate), checked on natural-photo
patches (`photo_patches`, from scikit-learn's sample images, no download), and the sets it writes.
"""

import colorsys
import io
import json
from itertools import pairwise

import numpy as np
import pytest
import torch
from scipy.ndimage import zoom as scipy_zoom

from dbsn.data import shift
from dbsn.data.base import DatasetNotFoundError
from dbsn.data.ood import photo_patches
from dbsn.data.shift import generate
from tests.support.fakedata import write_published


@pytest.fixture(scope="module")
def patches() -> np.ndarray:
    """64 natural-photo patches, uint8 (64, 3, 32, 32)."""
    return photo_patches(64, 0).numpy()


# ----- generator -------------------------------------------------------------------------------
def changes(images: np.ndarray, name: str, seed: int = 0) -> list[float]:
    """Mean absolute pixel change from the clean images, per severity."""
    clean = images.astype(np.float64)
    return [
        float(np.abs(shift.corrupt(images, name, s, shift.severity_rng(seed, name, s)) - clean).mean())
        for s in shift.SEVERITIES
    ]


# Corruptions whose CIFAR parameters do not make the pixel change grow with every severity; what
# holds for them is checked in their own tests below.
NOT_MONOTONE = {"glass_blur", "motion_blur", "saturate", "elastic_transform"}
# Corruptions that draw no random numbers.
DETERMINISTIC = {
    "defocus_blur", "zoom_blur", "brightness", "contrast", "pixelate", "jpeg_compression", "gaussian_blur", "saturate",
}  # fmt: skip


@pytest.mark.parametrize("name", shift.GENERATED_CORRUPTIONS)
def test_generated_output_is_uint8_of_the_input_shape_and_reproducible(patches, name):
    images = patches[:16]
    for severity in (1, 5):
        out = shift.corrupt(images, name, severity, np.random.default_rng(3))
        assert out.dtype == np.uint8 and out.shape == images.shape
        assert not np.array_equal(out, images)
        assert np.array_equal(out, shift.corrupt(torch.from_numpy(images), name, severity, np.random.default_rng(3)))
        other = shift.corrupt(images, name, severity, np.random.default_rng(4))
        assert np.array_equal(out, other) == (name in DETERMINISTIC)


@pytest.mark.parametrize("name", sorted(set(shift.GENERATED_CORRUPTIONS) - NOT_MONOTONE))
def test_pixel_change_grows_with_severity(patches, name):
    change = changes(patches, name)
    assert all(later > earlier for earlier, later in pairwise(change)), change


def test_glass_blur_change_is_set_by_the_number_of_passes(patches):
    """Severities 1-3 make one copy pass, 4-5 two. Within a pass count a larger sigma (0.05, 0.25,
    0.4; 0.25, 0.4) blurs the copied pixels back toward the clean image, so severity 3 changes
    about as much as 2 and severity 5 less than 4: only the pass count orders the change."""
    change = changes(patches, "glass_blur")
    assert max(change[:3]) < min(change[3:]), change
    assert change[4] < change[3], change


def test_motion_blur_severities_3_and_4_are_the_same_blur(patches):
    """(radius, sigma) = (6, 2) and (8, 2): the radius only sets the number of taps, and taps past
    12 weigh exp(-169/8) < 1e-9, so the two severities differ only by their random angles."""
    assert np.array_equal(shift.corrupt(patches, "motion_blur", 3, np.random.default_rng(7)),
                          shift.corrupt(patches, "motion_blur", 4, np.random.default_rng(7)))  # fmt: skip
    change = changes(patches, "motion_blur")
    assert change[0] < change[1] < change[2] and change[3] < change[4] and change[2] < change[4], change
    assert abs(change[3] - change[2]) < 0.1 * change[2], change


def test_motion_blur_kernel_reads_along_the_angle_on_one_side():
    """A bright pixel smears only to where the line kernel reaches it from: at angle 0 a pixel
    reads itself and the pixels to its right, so the smear runs to the left, on the same row."""
    image = np.zeros((1, 32, 32, 1))
    image[0, 16, 16, 0] = 1.0
    out = generate._motion_kernel_blur(image, 6, 2, np.array([0.0]))[0, ..., 0]
    rows, cols = np.nonzero(out > 1e-12)
    assert set(rows) == {16} and cols.max() == 16 and cols.min() == 16 - 12
    assert np.isclose(out.sum(), 1.0) and out[16, 16] > out[16, 15] > out[16, 10]
    down = generate._motion_kernel_blur(image, 6, 2, np.array([90.0]))[0, ..., 0]
    rows, cols = np.nonzero(down > 1e-12)
    assert set(cols) == {16} and rows.max() == 16 and rows.min() == 4


class FixedAngles:
    """Stands in for the generator where a corruption draws its blur angles: every angle is `angle`."""

    def __init__(self, angle: float):
        self.angle = angle

    def uniform(self, low, high, size):
        return np.full(size, self.angle)


def test_imagemagick_8bit_truncates_the_16_bit_quantum():
    """ImageMagick holds the blurred value as a 16-bit quantum (x 257, rounded) and writes its
    8-bit PNG by truncating that: a floor, except within 0.5/257 below the next level."""
    blurred = np.array([0.0, 0.75, 3.5, 66.52, 127.9, 254.6, 255.0, 7.9979, 7.9981, 254.99999999999994, 300.0])
    expected = [0, 0, 3, 66, 127, 254, 255, 7, 8, 255, 255]
    assert generate._imagemagick_8bit(blurred).tolist() == expected
    assert generate._imagemagick_8bit(blurred).dtype == np.uint8


def test_motion_blur_stores_the_blurred_values_truncated_not_rounded():
    """One pixel of 200 on black, angle 0, (radius, sigma) = (6, 2): the 13 pixels to its left on
    its row get 200 w_k, w_k proportional to exp(-k^2 / 8). Where 200 w_k has a fractional part
    above 0.5 the stored value is still its floor (rounding, as ImageMagick does not, adds 1)."""
    image = np.zeros((1, 32, 32, 3), np.uint8)
    image[0, 16, 16] = 200
    weights = np.exp(-(np.arange(13) ** 2) / 8.0)
    values = 200 * weights / weights.sum()
    above_half = (values % 1 > 0.5) & (values % 1 < 0.99)
    assert above_half.sum() >= 3, values  # the crafted case has values that rounding would move up
    out = generate._motion_blur(image, (6, 2), FixedAngles(0.0))
    expected = np.zeros((32, 32), np.uint8)
    expected[16, 16 - np.arange(13)] = np.floor(values)
    for channel in range(3):
        assert np.array_equal(out[0, ..., channel], expected), (out[0, 16, 2:17, channel], values)


def test_motion_blur_keeps_a_flat_image_flat():
    """A flat region blurs to itself in exact arithmetic; the float sum lands just below the value
    (255 -> 254.99999999999994 for some kernels) and must not lose a level to the truncation."""
    for radius, sigma in shift.PARAMETERS["motion_blur"]:
        for value in (1, 7, 128, 254, 255):
            flat = np.full((3, 32, 32, 3), value, np.uint8)
            out = generate._motion_blur(flat, (radius, sigma), np.random.default_rng(value))
            assert np.all(out == value), (radius, sigma, value, np.unique(out))


def test_snow_truncates_its_blurred_layer(monkeypatch):
    """Snow's flake layer goes through ImageMagick's motion blur in the original, so it is stored
    truncated too: a blurred layer of 100.75 everywhere adds 2 x 100/255 to the image (rounding
    would add 2 x 101/255). On black, the image part is (1 - mix) x 0.5."""
    monkeypatch.setattr(generate, "_motion_kernel_blur", lambda x, radius, sigma, angles: np.full(x.shape, 100.75))
    black = np.zeros((2, 3, 32, 32), np.uint8)
    for severity in shift.SEVERITIES:
        mix = shift.PARAMETERS["snow"][severity - 1][-1]
        out = shift.corrupt(black, "snow", severity, np.random.default_rng(0))
        expected = int(((1 - mix) * 0.5 + 2 * 100 / 255) * 255)
        assert expected != int(((1 - mix) * 0.5 + 2 * 101 / 255) * 255)
        assert np.all(out == expected), (severity, np.unique(out), expected)


def test_motion_blur_matches_imagemagick():
    """The own line kernel with ImageMagick's 8-bit step against Wand's motion_blur (the original
    script's call) on random RGB and grey 32x32 images, at the (radius, sigma) of motion blur and
    of snow's layer, at random angles: the same value for at least 99 % of the values (ImageMagick
    6.9.11 Q16 gave 100 %; rounding, generator version 1, about 50 %)."""
    wand_image = pytest.importorskip(
        "wand.image", reason="needs Wand (pip install wand) and ImageMagick's MagickWand library"
    )
    from PIL import Image
    from wand.version import QUANTUM_DEPTH

    if QUANTUM_DEPTH != 16:
        pytest.skip(f"ImageMagick is built with {QUANTUM_DEPTH}-bit quanta; the original's (and the model's) is 16")

    def imagemagick(image, radius, sigma, angle):
        png = io.BytesIO()
        Image.fromarray(image).save(png, format="PNG")
        with wand_image.Image(blob=png.getvalue()) as blurred:
            blurred.motion_blur(radius=radius, sigma=sigma, angle=angle)
            blob = blurred.make_blob("png")
        return np.asarray(Image.open(io.BytesIO(blob)).convert("RGB" if image.ndim == 3 else "L"))

    rng = np.random.default_rng(0)
    rgb = rng.integers(0, 256, size=(4, 32, 32, 3), dtype=np.uint8)
    rgb[:, :8] = 255  # flat rows: sums that land just below an integer
    grey = (np.clip(rng.normal(0.3, 0.3, size=(4, 32, 32)), 0, 1) * 255).astype(np.uint8)  # a snow-like layer
    grey[grey < 150] = 0
    kernels = shift.PARAMETERS["motion_blur"] + tuple(c[4:6] for c in shift.PARAMETERS["snow"])
    for images in (rgb, grey):
        for radius, sigma in kernels:
            angles = rng.uniform(-135, 45, len(images))
            ours = generate._imagemagick_8bit(
                generate._motion_kernel_blur(
                    images.reshape(*images.shape[:3], -1).astype(np.float64), radius, sigma, angles
                )
            ).reshape(images.shape)
            theirs = np.stack([imagemagick(image, radius, sigma, angle) for image, angle in zip(images, angles)])
            agreement = (ours == theirs).mean()
            assert agreement >= 0.99, (images.shape, radius, sigma, agreement)
            assert np.abs(ours.astype(int) - theirs).max() <= 1


def test_saturate_lowers_saturation_at_severities_1_2_and_raises_it_at_3_to_5(patches):
    """(a, b) = (0.3, 0), (0.1, 0), (1.5, 0), (2, 0.1), (2.5, 0.2) on S: severities 1-2 grey the
    image, 3-5 saturate it, so the change dips at severity 3 (S x 1.5 moves less than S x 0.1)."""

    def saturation(images):
        return generate._rgb_to_hsv(images.transpose(0, 2, 3, 1) / 255.0)[..., 1].mean()

    levels = [saturation(shift.corrupt(patches, "saturate", s, np.random.default_rng(0))) for s in shift.SEVERITIES]
    assert levels[1] < levels[0] < saturation(patches) < levels[2] < levels[3] < levels[4], levels
    change = changes(patches, "saturate")
    assert change[0] < change[1] and change[2] < change[3] < change[4] and change[2] == min(change), change


def test_elastic_transform_warps_more_locally_and_less_globally_with_severity(patches):
    """CIFAR's (alpha, sigma, affine) shrink the random affine shift from 2.56 to 0.96 pixels while
    the smooth displacement field grows (alpha / sigma from 0 to 3.3), and the affine part moves
    more pixels: the total change falls with severity, the field's part alone grows."""
    change = changes(patches, "elastic_transform")
    assert all(later < earlier for earlier, later in pairwise(change)), change
    hwc = np.ascontiguousarray(patches.transpose(0, 2, 3, 1))
    field_only = [
        np.abs(
            generate._elastic_transform(hwc, (alpha, sigma, 0.0), np.random.default_rng(s)) - hwc.astype(float)
        ).mean()
        for s, (alpha, sigma, _) in enumerate(shift.PARAMETERS["elastic_transform"])
    ]
    assert field_only[0] == 0 and all(later > earlier for earlier, later in pairwise(field_only)), field_only


@pytest.mark.parametrize("name", ["frost", "spatter"])
def test_frost_and_spatter_cannot_be_generated(patches, name):
    with pytest.raises(ValueError, match=f"{name} cannot be generated") as error:
        shift.corrupt(patches[:2], name, 1, np.random.default_rng(0))
    if name == "frost":
        assert "photographs" in str(error.value)


def test_corrupt_refuses_other_layouts(patches):
    with pytest.raises(ValueError, match=r"uint8 \(N, 3, 32, 32\)"):
        shift.corrupt(patches.transpose(0, 2, 3, 1), "fog", 1, np.random.default_rng(0))
    with pytest.raises(ValueError, match="uint8"):
        shift.corrupt(patches.astype(np.float32), "fog", 1, np.random.default_rng(0))


def test_glass_blur_gather_equals_the_original_sequential_scan(patches):
    """The original visits (h, w) from 31 down to 2 and copies x[h + dy, w + dx] into x[h, w]
    one pixel after another; the batched gather must give the same image for the same draws."""
    images = np.ascontiguousarray(patches[:3].transpose(0, 2, 3, 1))
    for severity in (1, 5):
        sigma, delta, iterations = shift.PARAMETERS["glass_blur"][severity - 1]
        got = generate._glass_blur(images, (sigma, delta, iterations), np.random.default_rng(11))
        rng = np.random.default_rng(11)
        x = (generate._gaussian(images / 255.0, sigma) * 255).astype(np.uint8)
        scan = list(range(32 - delta, delta, -1))
        for _ in range(iterations):
            dy, dx = rng.integers(-delta, delta, size=(2, len(x), len(scan), len(scan)))
            for n in range(len(x)):
                for i, h in enumerate(scan):
                    for j, w in enumerate(scan):
                        x[n, h, w] = x[n, h + dy[n, i, j], w + dx[n, i, j]]
        expected = (np.clip(generate._gaussian(x / 255.0, sigma), 0, 1) * 255).astype(np.uint8)
        assert np.array_equal(got, expected)


@pytest.mark.parametrize("zoom", [1.0, 1.01, 1.05, 1.06, 1.13, 1.25, 1.75, 2.25])
def test_clipped_zoom_matches_scipy_zoom_of_the_centre_crop(zoom):
    """As the original: crop ceil(32 / zoom) from (32 - crop) // 2, scipy.ndimage.zoom order 1,
    keep 32 pixels from (size - 32) // 2."""
    x = np.random.default_rng(0).random((2, 32, 32, 3))
    crop = int(np.ceil(32 / zoom))
    top = (32 - crop) // 2
    expected = []
    for image in x:
        zoomed = scipy_zoom(image[top : top + crop, top : top + crop], (zoom, zoom, 1), order=1)
        trim = (zoomed.shape[0] - 32) // 2
        expected.append(zoomed[trim : trim + 32, trim : trim + 32])
    np.testing.assert_allclose(generate._clipped_zoom(x, zoom), np.stack(expected), atol=1e-12)


def test_hsv_conversions_match_colorsys():
    rgb = np.random.default_rng(0).random((500, 3))
    rgb[:50, 1] = rgb[:50, 0]  # ties for the largest channel
    rgb[50:60] = 0.25  # greys
    hsv = generate._rgb_to_hsv(rgb)
    np.testing.assert_allclose(hsv, [colorsys.rgb_to_hsv(*v) for v in rgb], atol=1e-12)
    np.testing.assert_allclose(generate._hsv_to_rgb(hsv), rgb, atol=1e-12)


def test_defocus_kernels_are_normalised_and_symmetric():
    for radius, alias in shift.PARAMETERS["defocus_blur"]:
        kernel = generate._disk(radius, alias)
        assert np.isclose(kernel.sum(), 1.0, atol=1e-6)
        np.testing.assert_allclose(kernel, kernel.T, atol=1e-7)
        np.testing.assert_allclose(kernel, kernel[::-1], atol=1e-7)


# ----- generated sets --------------------------------------------------------------------------
def test_generated_set_round_trips_through_the_reader(tmp_path, patches):
    images, labels = patches[:6], np.array([3, 1, 4, 1, 5, 9])
    folder = tmp_path / "CIFAR-10-C-generated"
    names = ["fog", "glass_blur", "jpeg_compression"]
    shift.write_generated_set(folder, images, labels, names, seed=5, source="six patches")
    assert shift.is_generated(folder)
    marker = json.loads((folder / shift.MARKER).read_text())
    assert marker["generated"] is True and "not the published" in marker["note"]
    assert marker["seed"] == 5 and marker["corruptions"] == names
    assert marker["generator_version"] == shift.GENERATOR_VERSION and marker["source"] == "six patches"
    assert np.load(folder / "labels.npy").dtype == np.uint8 and np.load(folder / "fog.npy").shape == (30, 32, 32, 3)
    assert not list(folder.glob("*.partial"))
    shift.check_corrupted_files(folder, names)
    for name in names:
        for severity in shift.SEVERITIES:
            read, y = shift.corrupted_split(folder, name, severity)
            expected = shift.corrupt(images, name, severity, shift.severity_rng(5, name, severity))
            assert np.array_equal(read.numpy(), expected)
            assert y.tolist() == labels.tolist()
    with pytest.raises(DatasetNotFoundError, match="generated set"):
        shift.check_corrupted_files(folder, ["frost"])


def test_a_published_layout_without_the_marker_is_not_generated(tmp_path, patches):
    write_published(tmp_path / "CIFAR-10-C")
    assert not shift.is_generated(tmp_path / "CIFAR-10-C")
    with pytest.raises(FileExistsError, match="published"):
        shift.write_generated_set(tmp_path / "CIFAR-10-C", patches[:2], np.zeros(2, int), ["fog"])
    assert not shift.is_generated(tmp_path / "CIFAR-10-C")


def test_write_refuses_frost_before_writing_anything(tmp_path, patches):
    with pytest.raises(ValueError, match="frost cannot be generated"):
        shift.write_generated_set(tmp_path / "out", patches[:2], np.zeros(2, int), ["fog", "frost"])
    assert not (tmp_path / "out").exists()
