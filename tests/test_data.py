import pytest
import torch

from labkit import data


def test_mydataset_is_the_documents_shape_and_seeded():
    ds = data.MyDataset()
    assert len(ds) == 1000
    x, y = ds[3]
    assert x.shape == y.shape == (10,)
    assert torch.equal(ds.data, data.MyDataset().data)
    assert not torch.equal(ds.data, data.MyDataset(seed=1).data)


def test_teacher_targets_have_unit_variance_and_the_asked_noise():
    ds = data.TeacherDataset(n=4000, noise=0.1, seed=3)
    assert abs(ds.target.var().item() - 1.0) < 0.05
    twin = data.TeacherDataset(n=4000, noise=0.0, seed=3)
    assert torch.equal(ds.data, twin.data)
    residual = (ds.target - twin.target).std().item()
    assert abs(residual - 0.1) < 0.01


@pytest.mark.parametrize("cls", [data.MyDataset, data.TeacherDataset])
def test_empty_data_set_is_refused(cls):
    with pytest.raises(ValueError, match="n must be >= 1"):
        cls(n=0)


def test_loader_order_is_fixed_by_the_seed():
    ds = data.MyDataset(n=50)

    def order(seed):
        return torch.cat([x[:, 0] for x, _ in data.make_loader(ds, 8, seed=seed)])

    assert torch.equal(order(0), order(0))
    assert not torch.equal(order(0), order(1))
    with pytest.raises(ValueError, match="batch_size"):
        data.make_loader(ds, batch_size=0)
