"""The custom-objects API with the Eagle3Target CRD installed, for the tests that resolve targets by name."""

import kubernetes
import pytest


@pytest.fixture
def objects(cluster, crd) -> kubernetes.client.CustomObjectsApi:
    return kubernetes.client.CustomObjectsApi(cluster.api_client)
