import torch
from torch import nn

torch.manual_seed(0)
model = nn.Sequential(
    nn.Conv2d(1, 4, 3, padding=1), nn.BatchNorm2d(4), nn.ReLU(), nn.Flatten(), nn.Linear(4 * 6 * 6, 3)
)
opt = torch.optim.SGD(model.parameters(), lr=0.1)
X = torch.randn(16, 1, 6, 6)
Y = torch.randint(0, 3, (16,))
for step in range(4):
    opt.zero_grad()
    loss = nn.functional.cross_entropy(model(X), Y)
    loss.backward()
    opt.step()
